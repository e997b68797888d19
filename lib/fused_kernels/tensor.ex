defmodule FusedKernels.Tensor do
  @moduledoc """
  The tensor boundary: what ops accept and how results come back.

  Natively a tensor is a `{binary, shape_tuple, type}` triple with Nx's type tuples
  (`{:f, 32}`, `{:f, 16}`, `{:bf, 16}`; `{:f, 64}` on the CPU) or a `FusedKernels.Buffer`.
  With Nx loaded, `Nx.Tensor`s convert to and from triples here, in one place.
  """

  # The Nx-facing API compiles only when Nx is loaded. A build that asked for it must not end
  # up without it silently (a path dependency compiled before Nx): it is asked for when this
  # project's own deps list Nx (the hex build) or `config :fused_kernels, require_nx: true`.
  # Builds without Nx on purpose (CI without hex, native-only users) ask for neither.
  nx_requested? =
    Application.compile_env(:fused_kernels, :require_nx, false) or
      (Code.ensure_loaded?(Mix.Project) and
         Enum.any?(List.wrap(Mix.Project.config()[:deps]), &(elem(&1, 0) == :nx)))

  if nx_requested? and not Code.ensure_loaded?(Nx) do
    raise CompileError,
      description:
        "fused_kernels: Nx was requested (a dependency of fused_kernels, or config " <>
          ":fused_kernels, require_nx: true) but is not compiled yet, so the Nx-facing API " <>
          "(FusedKernels.scaled_softmax/2, lstm/3, ...) would be missing. Compile Nx before " <>
          "fused_kernels (e.g. `mix deps.compile nx fused_kernels --force`)."
  end

  @typedoc "A host tensor at the NIF boundary: `{binary, shape, type}` with Nx's type tuples."
  @type triple :: {binary, tuple, {atom, pos_integer}}

  @typedoc "What native calls return: a triple, or a buffer (`out: :device`)."
  @type result :: triple | FusedKernels.Buffer.t()

  if Code.ensure_loaded?(Nx) do
    @typedoc "An Nx tensor."
    @type nx :: Nx.Tensor.t()
  else
    @typedoc "An Nx tensor (Nx is not loaded in this build)."
    @type nx :: struct
  end

  @typedoc "What ops take: an Nx tensor or a number (with Nx), a buffer or a triple."
  @type t :: nx | number | result

  @doc "The value passed to a NIF for `tensor`."
  @spec to_native(FusedKernels.Tensor.t()) :: triple | reference
  def to_native(%FusedKernels.Buffer{ref: ref}), do: ref

  def to_native({bin, shape, type} = triple)
      when is_binary(bin) and is_tuple(shape) and is_tuple(type),
      do: triple

  if Code.ensure_loaded?(Nx) do
    def to_native(%Nx.Tensor{} = t), do: {Nx.to_binary(t), Nx.shape(t), Nx.type(t)}
  end

  def to_native(other) do
    raise ArgumentError,
          "expected an Nx tensor, a FusedKernels.Buffer or a {binary, shape, type} triple, got: " <>
            inspect(other, limit: 5)
  end

  if Code.ensure_loaded?(Nx) do
    @doc "An Nx tensor from a NIF result (a triple) or a buffer (downloaded)."
    @spec to_nx(triple | FusedKernels.Buffer.t() | reference) :: nx
    def to_nx({bin, shape, type}), do: bin |> Nx.from_binary(type) |> Nx.reshape(shape)
    def to_nx(%FusedKernels.Buffer{} = b), do: b |> FusedKernels.Buffer.download() |> to_nx()
    def to_nx(ref) when is_reference(ref), do: ref |> FusedKernels.Buffer.wrap() |> to_nx()

    @float_types [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}]

    @doc """
    Checks an op's Nx input before any backend is chosen, so `:nx` refuses what the native
    backends refuse, in the same words: `name`'s type must be a float type, and with
    `rank: r` (an integer or a list) its rank, with `shape: s` (a tuple, `:_` for any size) its
    shape. `nil` (an absent optional input) passes. Raises `ArgumentError`.
    """
    @spec check!(String.t(), nx | nil, keyword) :: :ok
    def check!(name, t, rules \\ [])
    def check!(_name, nil, _rules), do: :ok

    def check!(name, %Nx.Tensor{} = t, rules) do
      {kind, bits} = type = Nx.type(t)

      unless type in @float_types do
        raise ArgumentError,
              "#{name}: unsupported type {:#{kind}, #{bits}}: expected {:f, 32}, {:f, 16}, " <>
                "{:bf, 16} or {:f, 64}"
      end

      shape = Nx.shape(t)

      case rules[:rank] do
        nil ->
          :ok

        ranks ->
          unless tuple_size(shape) in List.wrap(ranks) do
            raise ArgumentError,
                  "#{name}: expected rank #{Enum.join(List.wrap(ranks), " or ")}, got shape " <>
                    inspect(shape)
          end
      end

      case rules[:shape] do
        nil ->
          :ok

        want ->
          fits? =
            tuple_size(want) == tuple_size(shape) and
              Enum.all?(Enum.zip(Tuple.to_list(want), Tuple.to_list(shape)), fn {w, d} ->
                w == :_ or w == d
              end)

          unless fits? do
            shown =
              want |> Tuple.to_list() |> Enum.map_join(", ", &if(&1 == :_, do: "_", else: &1))

            raise ArgumentError, "#{name}: expected shape {#{shown}}, got #{inspect(shape)}"
          end
      end

      :ok
    end

    def check!(_name, _other, _rules), do: :ok

    @doc "Whether `t` is a symbolic `defn` expression rather than concrete data."
    @spec symbolic?(term) :: boolean
    def symbolic?(%Nx.Tensor{data: %Nx.Defn.Expr{}}), do: true
    def symbolic?(_), do: false
  else
    @spec symbolic?(term) :: boolean
    def symbolic?(_), do: false
  end
end
