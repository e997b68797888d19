defmodule FusedKernels.Options do
  @moduledoc """
  Option validation for every op, in one place, before any backend is chosen, so `:cuda`,
  `:cpu` and `:nx` refuse the same options with the same `ArgumentError`.

  An op declares its options as `[{key, {default, check}}]`; `validate!/2` refuses anything
  but a keyword list, unknown keys (naming the known ones) and values failing their check
  (naming the key, what it must be and what was given). The options every op shares
  (`backend`, `device`, `out`) come from `common/0`.
  """

  @typedoc "How a value is checked: a built-in rule, or `{description, predicate}`."
  @type check ::
          :any
          | :boolean
          | :number
          | :non_negative
          | :positive_integer
          | {:in, [term]}
          | {String.t(), (term -> boolean)}

  @type schema :: [{atom, {term, check}}]

  @backends [nil, :auto, :cuda, :cpu, :nx]

  # Numbers the NIF can take as an f64 (a bignum beyond it would raise ArithmeticError).
  @max_float 1.0e300

  @doc "`backend`, `device` and `out`, shared by every op."
  @spec common() :: schema
  def common do
    [
      backend: {nil, {:in, @backends}},
      device: {nil, {"nil or a non-negative integer", &(is_nil(&1) or non_neg_integer?(&1))}},
      out: {:host, {:in, [:host, :device]}}
    ]
  end

  @doc """
  Validates `opts` against `schema` (plus `common/0` unless `common: false`), returning a
  keyword list with every key present (defaults filled in). Raises `ArgumentError`.
  """
  @spec validate!(term, schema, keyword) :: keyword
  def validate!(opts, schema, flags \\ []) do
    schema = if Keyword.get(flags, :common, true), do: schema ++ common(), else: schema

    unless is_list(opts) and Keyword.keyword?(opts) do
      raise ArgumentError,
            "options must be a keyword list (e.g. [backend: :cpu]), got: #{inspect(opts, limit: 5)}"
    end

    unless Enum.all?(opts, fn {key, _} -> :lists.keymember(key, 1, schema) end) do
      unknown = Enum.reject(Keyword.keys(opts), &Keyword.has_key?(schema, &1))

      raise ArgumentError,
            "unknown keys #{inspect(Enum.uniq(unknown))} in options; the known keys are " <>
              inspect(Keyword.keys(schema))
    end

    # A prepared step call lasts tens of microseconds: the passing case builds no message.
    Enum.map(schema, fn {key, {default, check}} ->
      value = Keyword.get(opts, key, default)
      unless ok?(check, value), do: check!(key, value, check)
      {key, value}
    end)
  end

  @doc "Raises `ArgumentError` unless `value` (the option `key`) passes `check`."
  @spec check!(atom | String.t(), term, check) :: :ok
  def check!(key, value, check) do
    {ok?, expected} = rule(check, value)

    if ok? do
      :ok
    else
      raise ArgumentError, "#{key} must be #{expected}, got: #{inspect(value, limit: 5)}"
    end
  end

  # `rule/2`'s verdict without its description.
  defp ok?(:any, _v), do: true
  defp ok?(:boolean, v), do: is_boolean(v)
  defp ok?({:in, values}, v), do: :lists.member(v, values)
  defp ok?(check, v), do: elem(rule(check, v), 0)

  defp rule(:any, _v), do: {true, "anything"}
  defp rule(:boolean, v), do: {is_boolean(v), "a boolean"}
  defp rule(:number, v), do: {number?(v), "a number"}

  defp rule(:non_negative, v),
    do: {number?(v) and v >= 0, "a non-negative number"}

  defp rule(:positive_integer, v),
    do: {is_integer(v) and v > 0, "a positive integer"}

  defp rule({:in, values}, v) do
    expected =
      case Enum.reject(values, &is_nil/1) do
        [a, b] -> "#{inspect(a)} or #{inspect(b)}"
        named -> "one of #{inspect(named)}"
      end

    {v in values, expected}
  end

  defp rule({expected, fun}, v) when is_function(fun, 1), do: {fun.(v) == true, expected}

  @doc "A finite number the native layer can take as an f64 (floats, and integers within range)."
  @spec number?(term) :: boolean
  def number?(v) when is_float(v), do: true
  def number?(v) when is_integer(v), do: abs(v) <= @max_float
  def number?(_), do: false

  defp non_neg_integer?(v), do: is_integer(v) and v >= 0 and v <= 2_147_483_647
end
