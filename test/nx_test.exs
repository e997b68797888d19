# Compiled only where Nx is loaded (its tests are tagged :nx as well).
if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.NxTest do
    # The Nx-facing API: every backend gives the reference answer, and the pure-Nx path works
    # inside defn.
    use ExUnit.Case, async: true
    @moduletag :nx

    alias FusedKernels.TestRef

    defp random(shape, type) do
      bin = TestRef.encode(TestRef.random_list(Tuple.product(shape)), type)
      {bin |> Nx.from_binary(type) |> Nx.reshape(shape), TestRef.decode(bin, type)}
    end

    defp backends do
      [:nx, :cpu] ++ if(FusedKernels.Backend.cuda_available?(), do: [:cuda], else: [])
    end

    test "scaled_softmax on every backend matches the f64 reference" do
      for backend <- backends(),
          type <- [{:f, 32}, {:bf, 16}, {:f, 16}],
          shape <- [{1, 1}, {61, 61}, {3, 200}, {1, 4, 60, 60}, {2, 2, 13, 29}, {1, 1, 29, 13}],
          causal <- [false, true] do
        {x, xs} = random(shape, type)
        out = FusedKernels.scaled_softmax(x, scale: 0.37, causal: causal, backend: backend)
        assert Nx.shape(out) == shape and Nx.type(out) == type
        got = TestRef.decode(Nx.to_binary(out), type)
        err = TestRef.rel_l2(got, TestRef.softmax(xs, shape, 0.37, causal))

        assert err <= TestRef.tolerance(type),
               "#{backend} #{inspect(type)} #{inspect(shape)} causal=#{causal}: #{err}"
      end
    end

    test "inside defn the :auto backend takes the pure-Nx path" do
      {x, xs} = random({1, 2, 7, 9}, {:f, 32})

      fun =
        Nx.Defn.jit(&FusedKernels.scaled_softmax(&1, scale: 0.5, causal: true),
          compiler: Nx.Defn.Evaluator
        )

      out = fun.(x)
      got = TestRef.decode(Nx.to_binary(out), {:f, 32})
      assert TestRef.rel_l2(got, TestRef.softmax(xs, {1, 2, 7, 9}, 0.5, true)) <= 1.0e-5
    end

    test "inside defn a native backend is refused with a clear message" do
      {x, _} = random({2, 3}, {:f, 32})

      assert_raise ArgumentError, ~r/cannot run inside defn/, fn ->
        Nx.Defn.jit(&FusedKernels.scaled_softmax(&1, backend: :cpu), compiler: Nx.Defn.Evaluator).(
          x
        )
      end
    end

    test "bad arguments name themselves" do
      {x, _} = random({2, 3}, {:f, 32})

      assert_raise ArgumentError, ~r/causal must be a boolean/, fn ->
        FusedKernels.scaled_softmax(x, causal: 1)
      end

      assert_raise ArgumentError, ~r/unknown keys \[:scal\]/, fn ->
        FusedKernels.scaled_softmax(x, scal: 1)
      end

      assert_raise ArgumentError, ~r/x: scaled_softmax takes a 2-D/, fn ->
        FusedKernels.scaled_softmax(Nx.iota({2, 3, 4}, type: :f32), backend: :nx)
      end

      assert_raise ArgumentError, ~r/unsupported type \{:s, (32|64)\}/, fn ->
        FusedKernels.scaled_softmax(Nx.iota({2, 3}), backend: :cpu)
      end
    end
  end
end
