defmodule FusedKernels.DenseTest do
  # dense / swiglu / rms_norm_dense / layer_norm_dense through the NIF against an f64
  # reference written here in Elixir; CPU always, CUDA where a GPU is usable (:cuda tag).
  use ExUnit.Case, async: true

  alias FusedKernels.{Buffer, Dense, TestRef}

  @activations [:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh]

  # Random operands as triples plus their decoded values (rows of lists).
  defp tensor(shape, type, scale \\ 1.0, shift \\ 0.0) do
    vals = Enum.map(TestRef.random_list(Tuple.product(shape)), &(&1 * scale + shift))
    bin = TestRef.encode(vals, type)
    {{bin, shape, type}, TestRef.decode(bin, type)}
  end

  defp operands(kind, xshape, n, type, extras?) do
    k = elem(xshape, tuple_size(xshape) - 1)
    m = div(Tuple.product(xshape), k)
    ws = 1 / :math.sqrt(k)
    out_shape = put_elem(xshape, tuple_size(xshape) - 1, n)
    glu? = kind == :swiglu

    [
      x: tensor(xshape, type, 1.0, 0.5),
      kernel: tensor({k, n}, type, ws),
      kernel_up: glu? && tensor({k, n}, type, ws),
      bias: extras? && tensor({n}, type, 0.5),
      bias_up: extras? && glu? && tensor({n}, type, 0.5),
      gamma: kind in [:rms_norm_dense, :layer_norm_dense] && tensor({k}, type, 0.5, 1.0),
      beta: kind == :layer_norm_dense && tensor({k}, type, 0.5),
      residual: extras? && not glu? && tensor(out_shape, type)
    ]
    |> Enum.reject(fn {_, v} -> v == false end)
    |> Map.new()
    |> Map.put(:mkn, {m, k, n})
  end

  defp call(kind, o, act, opts) do
    t = fn slot -> if v = o[slot], do: elem(v, 0) end

    case kind do
      :dense ->
        Dense.dense(
          t.(:x),
          t.(:kernel),
          t.(:bias),
          [activation: act, residual: t.(:residual)] ++ opts
        )

      :swiglu ->
        Dense.swiglu(
          t.(:x),
          t.(:kernel),
          t.(:kernel_up),
          [bias_gate: t.(:bias), bias_up: t.(:bias_up)] ++ opts
        )

      :rms_norm_dense ->
        Dense.rms_norm_dense(
          t.(:x),
          t.(:gamma),
          t.(:kernel),
          [bias: t.(:bias), activation: act, residual: t.(:residual), eps: 1.0e-5] ++ opts
        )

      :layer_norm_dense ->
        Dense.layer_norm_dense(
          t.(:x),
          t.(:gamma),
          t.(:beta),
          t.(:kernel),
          [bias: t.(:bias), activation: act, residual: t.(:residual), eps: 1.0e-5] ++ opts
        )
    end
  end

  # The f64 reference, straight from the definitions.
  def reference(kind, o, act) do
    {m, k, n} = o.mkn
    v = fn slot -> if t = o[slot], do: elem(t, 1) end
    rows = Enum.chunk_every(v.(:x), k)
    w = v.(:kernel) |> Enum.chunk_every(n) |> Enum.zip() |> Enum.map(&Tuple.to_list/1)

    wu =
      v.(:kernel_up) &&
        v.(:kernel_up) |> Enum.chunk_every(n) |> Enum.zip() |> Enum.map(&Tuple.to_list/1)

    zeros = List.duplicate(0.0, n)
    bias = v.(:bias) || zeros
    bias_up = v.(:bias_up) || zeros
    res = if r = v.(:residual), do: Enum.chunk_every(r, n), else: List.duplicate(zeros, m)
    dot = fn a, b -> Enum.zip_with(a, b, &(&1 * &2)) |> Enum.sum() end

    rows
    |> Enum.zip(res)
    |> Enum.flat_map(fn {row, rrow} ->
      a = normalise(kind, row, v.(:gamma), v.(:beta))

      Enum.zip([w, wu || w, bias, bias_up, rrow])
      |> Enum.map(fn {wc, wuc, b, bu, r} ->
        y = dot.(a, wc) + b

        if kind == :swiglu,
          do: y / (1 + :math.exp(-y)) * (dot.(a, wuc) + bu) + r,
          else: act(act, y) + r
      end)
    end)
  end

  defp normalise(:dense, row, _, _), do: row
  defp normalise(:swiglu, row, _, _), do: row

  defp normalise(kind, row, g, b) do
    k = length(row)
    mean = if kind == :layer_norm_dense, do: Enum.sum(row) / k, else: 0.0
    var = Enum.sum(Enum.map(row, &((&1 - mean) * (&1 - mean)))) / k
    rstd = 1 / :math.sqrt(var + 1.0e-5)
    b = b || List.duplicate(0.0, k)
    Enum.zip_with([row, g, b], fn [x, g, b] -> (x - mean) * rstd * g + b end)
  end

  defp act(:none, y), do: y
  defp act(:relu, y), do: max(y, 0.0)
  defp act(:gelu, y), do: 0.5 * y * (1 + :math.erf(y / :math.sqrt(2)))

  defp act(:gelu_tanh, y),
    do: 0.5 * y * (1 + :math.tanh(:math.sqrt(2 / :math.pi()) * (y + 0.044715 * y * y * y)))

  defp act(:silu, y), do: y / (1 + :math.exp(-y))
  defp act(:sigmoid, y), do: 1 / (1 + :math.exp(-y))
  defp act(:tanh, y), do: :math.tanh(y)

  def check(backend, kind, xshape, n, type, acts) do
    for extras? <- [false, true], act <- acts do
      o = operands(kind, xshape, n, type, extras?)
      {bin, shape, ^type} = call(kind, o, act, backend: backend)
      assert shape == put_elem(xshape, tuple_size(xshape) - 1, n)
      err = TestRef.rel_l2(TestRef.decode(bin, type), reference(kind, o, act))

      assert err <= TestRef.tolerance(type),
             "#{backend} #{kind} #{act} #{inspect(type)} #{inspect(xshape)}x#{n} extras=#{extras?}: #{err}"
    end
  end

  @kinds [:dense, :swiglu, :rms_norm_dense, :layer_norm_dense]
  @shapes [{{1, 24}, 40}, {{5, 61}, 37}, {{2, 3, 16}, 24}, {{16}, 24}]

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}] do
    test "cpu dense ops match the f64 reference for #{inspect(type)}" do
      for kind <- @kinds, {xs, n} <- @shapes do
        acts = if kind == :swiglu, do: [:none], else: @activations
        check(:cpu, kind, xs, n, unquote(Macro.escape(type)), acts)
      end
    end
  end

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
    @tag :cuda
    test "cuda dense ops match the f64 reference for #{inspect(type)}" do
      for kind <- @kinds, {xs, n} <- @shapes ++ [{{60, 256}, 96}] do
        acts = if kind == :swiglu, do: [:none], else: @activations
        check(:cuda, kind, xs, n, unquote(Macro.escape(type)), acts)
      end
    end
  end

  @tag :cuda
  test "weights resident on the GPU feed every dense op; results can stay there" do
    o = operands(:layer_norm_dense, {2, 30, 64}, 48, {:f, 32}, true)
    [x, g, b, w, bias] = Enum.map([:x, :gamma, :beta, :kernel, :bias], &elem(o[&1], 0))
    host = Dense.layer_norm_dense(x, g, b, w, bias: bias, backend: :cuda)
    bufs = Enum.map([g, b, w, bias], &Buffer.upload/1)
    [gb, bb, wb, biasb] = bufs
    dev = Dense.layer_norm_dense(x, gb, bb, wb, bias: biasb, backend: :cuda, out: :device)
    assert %Buffer{shape: {2, 30, 48}} = dev
    assert Buffer.download(dev) == host
  end

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}] do
    test "a prepared kernel matches the f64 reference and the plain kernel for #{inspect(type)}" do
      type = unquote(Macro.escape(type))

      for {xs, n} <- @shapes ++ [{{1, 96}, 520}, {{61, 40}, 200}],
          extras? <- [false, true],
          act <- @activations do
        o = operands(:dense, xs, n, type, extras?)
        t = fn slot -> if v = o[slot], do: elem(v, 0) end
        prepared = Dense.prepare(t.(:kernel), t.(:bias), backend: :cpu)
        assert is_reference(prepared.ref) == unquote(type != {:f, 64})
        opts = [activation: act, residual: t.(:residual), backend: :cpu]
        # Twice: the second call reuses the handle's scratch.
        {bin, shape, ^type} = Dense.dense(t.(:x), prepared, opts)
        assert {^bin, ^shape, ^type} = Dense.dense(t.(:x), prepared, opts)
        assert shape == put_elem(xs, tuple_size(xs) - 1, n)
        got = TestRef.decode(bin, type)
        tol = TestRef.tolerance(type)
        ref = reference(:dense, o, act)
        assert TestRef.rel_l2(got, ref) <= tol, "#{inspect(xs)}x#{n} #{act} extras=#{extras?}"
        {plain, _, _} = Dense.dense(t.(:x), t.(:kernel), t.(:bias), opts)
        assert TestRef.rel_l2(got, TestRef.decode(plain, type)) <= tol
      end
    end
  end

  # native/fused_kernels_nif/src/ops/dense.rs `is_short`: a first call of up to 2^25
  # multiply-adds continues on a dirty scheduler (the NIF answers the reply itself), a larger
  # one is queued on the job lanes (the NIF answers a reference, the reply follows).
  test "a short prepared call runs on a dirty scheduler, a long one on the job lanes" do
    w = elem(tensor({256, 128}, {:f, 32}, 0.0625), 0)
    small = elem(tensor({8, 256}, {:f, 32}), 0)
    large = elem(tensor({1100, 256}, {:f, 32}), 0)

    for {x, routed} <- [{small, :dirty}, {large, :lanes}] do
      # A fresh handle each time: its first call is routed by size.
      p = Dense.prepare(w, backend: :cpu)
      args = [%{kernel: p.ref, x: x, residual: nil}, %{activation: :gelu}]

      assert {^routed, reply} = TestRef.cpu_route(:dense_prepared, args)
      # Either way the same result as the dirty NIF that runs every size.
      assert {:ok, {bin, _, {:f, 32}}} = reply
      assert {:ok, {^bin, _, _}} = apply(FusedKernels.Native, :dense_prepared_dirty, args)
    end
  end

  test "a prepared kernel of the wrong size or type raises ArgumentError naming it" do
    o = operands(:dense, {4, 8}, 6, {:f, 32}, true)
    [x, w, bias] = Enum.map([:x, :kernel, :bias], &elem(o[&1], 0))
    prepared = Dense.prepare(w, bias, backend: :cpu)

    assert_raise ArgumentError, ~r/^x: expected last dimension 8/, fn ->
      Dense.dense(elem(tensor({4, 7}, {:f, 32}), 0), prepared, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^x: has type f16 but the kernel was prepared as f32/, fn ->
      Dense.dense(elem(tensor({4, 8}, {:f, 16}), 0), prepared, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^residual: expected shape \{4, 6\}/, fn ->
      Dense.dense(x, prepared, residual: elem(tensor({4, 5}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^bias: the prepared kernel holds its bias/, fn ->
      Dense.dense(x, prepared, bias, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^bias: expected shape \{6\}/, fn ->
      Dense.prepare(w, elem(tensor({5}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError,
                 ~r/^kernel: expected a kernel from FusedKernels.Dense.prepare/,
                 fn ->
                   %{kernel: make_ref(), x: x}
                   |> FusedKernels.Native.dense_prepared(%{activation: :none})
                   |> FusedKernels.Native.unwrap!()
                 end

    assert_raise ArgumentError, ~r/^kernel: already prepared/, fn -> Dense.prepare(prepared) end

    assert_raise ArgumentError, ~r/activation must be one of/, fn ->
      Dense.dense(x, prepared, activation: :swish, backend: :cpu)
    end

    if FusedKernels.Backend.cuda_available?() do
      assert_raise ArgumentError, ~r/^kernel: prepared for backend :cpu/, fn ->
        Dense.dense(x, prepared, backend: :cuda)
      end
    end
  end

  test "bad arguments raise ArgumentError naming the argument" do
    o = operands(:dense, {4, 8}, 6, {:f, 32}, true)
    [x, w, bias] = Enum.map([:x, :kernel, :bias], &elem(o[&1], 0))

    assert_raise ArgumentError, ~r/^kernel: expected shape \{8, units\}/, fn ->
      Dense.dense(x, elem(tensor({6, 8}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^bias: expected shape \{6\}/, fn ->
      Dense.dense(x, w, elem(tensor({5}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^residual: expected shape \{4, 6\}/, fn ->
      Dense.dense(x, w, bias, residual: elem(tensor({4, 5}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^bias: type f16 differs from x's f32/, fn ->
      Dense.dense(x, w, elem(tensor({6}, {:f, 16}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/activation must be one of/, fn ->
      Dense.dense(x, w, bias, activation: :swish, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/unknown keys \[:activation\]/, fn ->
      Dense.swiglu(x, w, w, activation: :gelu, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/eps must be a non-negative number/, fn ->
      Dense.rms_norm_dense(x, elem(tensor({8}, {:f, 32}), 0), w, eps: -1, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^norm_weight: expected shape \{8\}/, fn ->
      Dense.rms_norm_dense(x, bias, w, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^w_up: expected shape \{8, 6\}/, fn ->
      Dense.swiglu(x, w, elem(tensor({8, 5}, {:f, 32}), 0), backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^x: binary has 7 bytes/, fn ->
      Dense.dense({<<0::56>>, {1, 2}, {:f, 32}}, w, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^kernel: dimension 0 of shape \{0, 6\} is 0/, fn ->
      Dense.dense(x, {<<>>, {0, 6}, {:f, 32}}, backend: :cpu)
    end
  end
end
