defmodule FusedKernels.SpecsTest do
  # Every public function in lib/ carries a @spec (the lower arities of a function with
  # defaults are covered by the full one; behaviour callbacks take theirs from the
  # behaviour), so Dialyzer (test/dialyzer) checks callers against what the API promises.
  use ExUnit.Case, async: true

  # FusedKernels.Backbone* is being rebuilt over the native engine; its specs come with it.
  @pending [FusedKernels.Backbone]

  defp modules do
    {:ok, mods} = :application.get_key(:fused_kernels, :modules)

    Enum.reject(mods, fn m ->
      name = inspect(m)
      Enum.any?(@pending, &String.starts_with?(name, inspect(&1)))
    end)
  end

  defp callbacks(mod) do
    for b <- Keyword.get_values(mod.module_info(:attributes), :behaviour),
        b = List.first(b),
        Code.ensure_loaded?(b) and function_exported?(b, :behaviour_info, 1),
        cb <- b.behaviour_info(:callbacks),
        do: cb
  end

  test "every public function has a @spec" do
    missing =
      for mod <- modules(),
          {:ok, specs} <- [Code.Typespec.fetch_specs(mod)],
          specced = MapSet.new(specs, &elem(&1, 0)),
          {name, arity} = fa <- mod.__info__(:functions),
          not String.starts_with?(Atom.to_string(name), "__"),
          fa not in callbacks(mod),
          not (match?(%{__exception__: true}, safe_struct(mod)) and
                 fa in [exception: 1, message: 1]),
          not Enum.any?(arity..(arity + 6), &MapSet.member?(specced, {name, &1})),
          do: "#{inspect(mod)}.#{name}/#{arity}"

    assert missing == [], "no @spec: #{Enum.join(missing, ", ")}"
  end

  defp safe_struct(mod) do
    if function_exported?(mod, :__struct__, 0), do: mod.__struct__(), else: nil
  end
end
