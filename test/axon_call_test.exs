# Compiled only where Nx is loaded (its tests are tagged :nx as well).
if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.AxonCallTest do
    # Fused ops inside defn graphs: runtime_call on Nx >= 0.11, the pure-Nx path before; the
    # values and the gradients must equal the pure-Nx op's either way.
    use ExUnit.Case, async: true
    @moduletag :nx

    alias FusedKernels.Axon.Call
    alias FusedKernels.ScaledSoftmax

    defp x,
      do:
        Nx.tensor(for(_ <- 1..24, do: :rand.uniform() * 4 - 2), type: :f32)
        |> Nx.reshape({1, 2, 3, 4})

    test "values inside defn equal the pure-Nx op" do
      x = x()
      opts = [scale: 0.5, causal: true]

      fused =
        Nx.Defn.jit(fn t -> Call.run(ScaledSoftmax, {t}, opts) end, compiler: Nx.Defn.Evaluator).(
          x
        )

      plain = ScaledSoftmax.nx(x, opts)
      assert Nx.all_close(fused, plain, atol: 1.0e-6) |> Nx.to_number() == 1
    end

    test "gradients through the fused op equal the pure-Nx gradients" do
      x = x()
      w = Nx.iota({1, 2, 3, 4}, type: :f32) |> Nx.divide(10)
      opts = [scale: 0.7, causal: false]
      loss = fn f -> fn t -> t |> f.() |> Nx.multiply(w) |> Nx.sum() end end

      fused =
        Nx.Defn.jit(&Nx.Defn.grad(&1, loss.(fn t -> Call.run(ScaledSoftmax, {t}, opts) end)),
          compiler: Nx.Defn.Evaluator
        ).(x)

      plain =
        Nx.Defn.jit(&Nx.Defn.grad(&1, loss.(fn t -> ScaledSoftmax.nx(t, opts) end)),
          compiler: Nx.Defn.Evaluator
        ).(x)

      assert Nx.all_close(fused, plain, atol: 1.0e-6) |> Nx.to_number() == 1
    end

    test "the path follows the Nx line" do
      expected =
        cond do
          FusedKernels.XLA.available?() -> :exla
          function_exported?(Nx, :runtime_call, 4) -> :runtime_call
          true -> :nx
        end

      assert Call.path() == expected
      assert Call.path(backend: :nx) == :nx
    end
  end
end
