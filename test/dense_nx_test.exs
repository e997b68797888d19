# Compiled only where Nx is loaded (its tests are tagged :nx as well).
if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.DenseNxTest do
    # The Nx-facing dense ops: the pure-Nx path agrees with the native ones (themselves checked
    # against the f64 reference in dense_test.exs), leading dims are kept, and inside defn the
    # :auto backend takes the pure-Nx path.
    use ExUnit.Case, async: true
    @moduletag :nx

    alias FusedKernels.TestRef

    defp random(shape, type, scale \\ 1.0) do
      vals = Enum.map(TestRef.random_list(Tuple.product(shape)), &(&1 * scale))
      vals |> TestRef.encode(type) |> Nx.from_binary(type) |> Nx.reshape(shape)
    end

    defp backends,
      do: [:cpu] ++ if(FusedKernels.Backend.cuda_available?(), do: [:cuda], else: [])

    defp close!(a, b, type, what) do
      err =
        TestRef.rel_l2(
          TestRef.decode(Nx.to_binary(a), type),
          TestRef.decode(Nx.to_binary(b), type)
        )

      assert err <= 2 * TestRef.tolerance(type), "#{what}: #{err}"
    end

    test "every dense op on :nx matches the native backends" do
      for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], backend <- backends() do
        x = random({2, 5, 24}, type)
        w = random({24, 40}, type, 0.2)
        wu = random({24, 40}, type, 0.2)
        b = random({40}, type, 0.5)
        r = random({2, 5, 40}, type)
        g = Nx.add(random({24}, type, 0.5), 1) |> Nx.as_type(type)
        be = random({24}, type, 0.5)

        for act <- [:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh] do
          run = &FusedKernels.dense(x, w, b, activation: act, residual: r, backend: &1)
          out = run.(:nx)
          assert Nx.shape(out) == {2, 5, 40} and Nx.type(out) == type
          close!(out, run.(backend), type, "dense #{act} #{backend} #{inspect(type)}")
        end

        pairs = [
          {"swiglu", &FusedKernels.swiglu(x, w, wu, bias_gate: b, bias_up: b, backend: &1)},
          {"rms_norm_dense",
           &FusedKernels.rms_norm_dense(x, g, w, bias: b, activation: :silu, backend: &1)},
          {"layer_norm_dense",
           &FusedKernels.layer_norm_dense(x, g, be, w, residual: r, activation: :gelu, backend: &1)}
        ]

        for {name, run} <- pairs,
            do: close!(run.(:nx), run.(backend), type, "#{name} #{backend} #{inspect(type)}")
      end
    end

    test "a prepared kernel answers as the plain one on every backend, Nx tensors in and out" do
      for backend <- [:nx | backends()], type <- [{:f, 32}, {:bf, 16}] do
        x = random({3, 5, 40}, type)

        {w, b, r} =
          {random({40, 72}, type, 0.15), random({72}, type, 0.5), random({3, 5, 72}, type)}

        prepared = FusedKernels.Dense.prepare(w, b, backend: backend)
        assert is_reference(prepared.ref) == (backend == :cpu)

        for act <- [:none, :gelu, :relu] do
          opts = [activation: act, residual: r, backend: backend]
          got = FusedKernels.dense(x, prepared, opts)
          want = FusedKernels.dense(x, w, b, opts)
          assert Nx.shape(got) == {3, 5, 72} and Nx.type(got) == type
          close!(got, want, type, "prepared #{backend} #{inspect(type)} #{act}")
        end
      end
    end

    test "inside defn the :auto backend takes the pure-Nx path" do
      x = random({3, 16}, {:f, 32})
      g = random({16}, {:f, 32})
      w = random({16, 8}, {:f, 32}, 0.3)

      fun =
        Nx.Defn.jit(&FusedKernels.rms_norm_dense(&1, &2, &3, activation: :tanh),
          compiler: Nx.Defn.Evaluator
        )

      close!(
        fun.(x, g, w),
        FusedKernels.rms_norm_dense(x, g, w, activation: :tanh, backend: :cpu),
        {:f, 32},
        "defn"
      )
    end

    test "bad shapes name the argument on the pure-Nx path too" do
      x = random({3, 16}, {:f, 32})

      assert_raise ArgumentError, ~r/^kernel: expected shape \{16, units\}/, fn ->
        FusedKernels.dense(x, random({8, 4}, {:f, 32}), backend: :nx)
      end

      assert_raise ArgumentError, ~r/^bias_up: expected shape \{4\}/, fn ->
        w = random({16, 4}, {:f, 32})
        FusedKernels.swiglu(x, w, w, bias_up: random({5}, {:f, 32}), backend: :nx)
      end
    end
  end
end
