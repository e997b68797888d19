defmodule FusedKernels.FlashAttentionTest do
  # flash_attention on every backend against an f64 reference written here, plainly.
  use ExUnit.Case, async: true

  alias FusedKernels.{FlashAttention, TestRef}

  # {name, heads, kv_heads, opts}
  @masks [
    {"plain", 2, 2, []},
    {"causal", 2, 2, [causal: true]},
    {"window(10,0)", 2, 2, [window: {10, 0}]},
    {"window(32,8)", 2, 2, [window: {32, 8}]},
    {"gqa 4:2", 4, 2, [causal: true]},
    {"mqa", 3, 1, [scale: 0.3]}
  ]
  @seqs [{1, 1}, {1, 37}, {13, 13}, {11, 29}, {9, 4}]

  @doc false
  # Reference in f64 on {b, s, h, d} lists: {out (bshd list), lse list (b, h, sq)}.
  def reference(q, k, v, {b, sq, h, d}, {_, sk, kvh, _}, opts) do
    {q, k, v} = {List.to_tuple(q), List.to_tuple(k), List.to_tuple(v)}
    scale = opts[:scale] || 1.0 / :math.sqrt(d)
    {left, right} = Keyword.get(opts, :window, {-1, -1})
    right = if opts[:causal], do: 0, else: right
    at = fn t, seq, heads, bi, si, hi, c -> elem(t, ((bi * seq + si) * heads + hi) * d + c) end

    rows =
      for bi <- 0..(b - 1), hi <- 0..(h - 1), i <- 0..(sq - 1) do
        diag = i + sk - sq
        lo = if left < 0, do: 0, else: max(0, diag - left)
        up = if right < 0, do: sk - 1, else: min(sk - 1, diag + right)
        kh = div(hi, div(h, kvh))

        if lo > up do
          {List.duplicate(0.0, d), :inf}
        else
          s =
            for j <- lo..up do
              scale *
                Enum.sum(
                  for c <- 0..(d - 1),
                      do: at.(q, sq, h, bi, i, hi, c) * at.(k, sk, kvh, bi, j, kh, c)
                )
            end

          m = Enum.max(s)
          e = Enum.map(s, &:math.exp(&1 - m))
          z = Enum.sum(e)

          out =
            for c <- 0..(d - 1) do
              Enum.zip(lo..up, e)
              |> Enum.map(fn {j, p} -> p * at.(v, sk, kvh, bi, j, kh, c) end)
              |> Enum.sum()
              |> Kernel./(z)
            end

          {out, m + :math.log(z)}
        end
      end

    # rows are in (b, h, s) order; the output is (b, s, h).
    rows_t = List.to_tuple(rows)

    out =
      for bi <- 0..(b - 1), i <- 0..(sq - 1), hi <- 0..(h - 1) do
        elem(elem(rows_t, (bi * h + hi) * sq + i), 0)
      end

    {List.flatten(out), Enum.map(rows, &elem(&1, 1))}
  end

  @doc false
  def to_bhsd(list, {b, s, h, d}) do
    t = List.to_tuple(list)

    for bi <- 0..(b - 1),
        hi <- 0..(h - 1),
        si <- 0..(s - 1),
        c <- 0..(d - 1),
        do: elem(t, ((bi * s + si) * h + hi) * d + c)
  end

  @doc false
  def check(backend, type, d, runner \\ &FlashAttention.native/4) do
    for {name, h, kvh, opts} <- @masks, {sq, sk} <- @seqs, layout <- [:bshd, :bhsd] do
      {qs, ks} = {{2, sq, h, d}, {2, sk, kvh, d}}

      [q, k, v] =
        for s <- [qs, ks, ks], do: TestRef.encode(TestRef.random_list(Tuple.product(s)), type)

      [ql, kl, vl] = for bin <- [q, k, v], do: TestRef.decode(bin, type)
      {ref, ref_lse} = reference(ql, kl, vl, qs, ks, opts)

      {tr, shape} =
        case layout do
          :bshd -> {fn l, _ -> l end, fn s -> s end}
          :bhsd -> {&to_bhsd/2, fn {b, s, h, d} -> {b, h, s, d} end}
        end

      bin = fn l, s -> TestRef.encode(tr.(l, s), type) end

      {{out, _, ^type}, {lse, {2, ^h, ^sq}, {:f, 32}}} =
        runner.(
          {bin.(ql, qs), shape.(qs), type},
          {bin.(kl, ks), shape.(ks), type},
          {bin.(vl, ks), shape.(ks), type},
          [backend: backend, layout: layout, return_lse: true] ++ opts
        )

      what = "#{backend} #{inspect(type)} d#{d} #{layout} sq#{sq} sk#{sk} #{name}"
      err = TestRef.rel_l2(TestRef.decode(out, type), tr.(ref, qs))
      assert err <= TestRef.tolerance(type), "#{what}: rel L2 #{err}"

      got_lse = TestRef.decode(lse, {:f, 32})

      for {g, r} <- Enum.zip(got_lse, ref_lse) do
        # +inf decodes as :nan (Elixir floats hold no infinities).
        if r == :inf,
          do: assert(g == :nan, "#{what}: lse #{inspect(g)} for a fully masked row"),
          else: assert(abs(g - r) <= 1.0e-3 * max(1.0, abs(r)), "#{what}: lse #{g} vs #{r}")
      end
    end
  end

  for type <- [{:f, 32}, {:bf, 16}, {:f, 64}] do
    test "cpu matches the f64 reference for #{inspect(type)}" do
      check(:cpu, unquote(Macro.escape(type)), 5)
      check(:cpu, unquote(Macro.escape(type)), 16)
    end
  end

  # native/fused_kernels_nif/src/ops/flash_attention.rs `is_short`: up to 2^25 multiply-adds
  # the call continues on a dirty scheduler (the NIF answers the reply), above it is queued
  # on the job lanes (the NIF answers a reference); the same result either way.
  test "a short cpu call runs on a dirty scheduler, a long one on the job lanes" do
    for {s, routed} <- [{60, :dirty}, {1100, :lanes}] do
      x = {TestRef.encode(TestRef.random_list(s * 4 * 64), {:f, 32}), {1, s, 4, 64}, {:f, 32}}
      opts = %{layout: :bshd, scale: nil, causal: true, window: {-1, -1}, return_lse: false}
      opts = Map.merge(opts, %{backend: :cpu, device: nil, out: :host})
      args = [%{q: x, k: x, v: x}, opts]

      assert {^routed, reply} = TestRef.cpu_route(:flash_attention, args)
      assert {:ok, {bin, {1, ^s, 4, 64}, {:f, 32}}} = reply
      assert {:ok, {^bin, _, _}} = apply(FusedKernels.Native, :flash_attention_dirty, args)
    end
  end

  test "bad arguments raise ArgumentError naming the argument" do
    t = fn shape, type ->
      {TestRef.encode(TestRef.random_list(Tuple.product(shape)), type), shape, type}
    end

    f = {:f, 32}
    q = t.({1, 4, 2, 8}, f)

    cases = [
      {[t.({1, 4, 3, 8}, f), q, q, []], ~r/multiple/},
      {[q, q, t.({1, 5, 2, 8}, f), []], ~r/^v:/},
      {[q, t.({1, 4, 2, 8}, {:bf, 16}), q, []], ~r/type/},
      {[t.({1, 4, 1, 300}, f), t.({1, 4, 1, 300}, f), t.({1, 4, 1, 300}, f), []], ~r/256/},
      {[t.({4, 2, 8}, f), q, q, []], ~r/^q:/},
      {[q, q, q, [window: {-2, 0}]], ~r/window/},
      {[q, q, q, [layout: :sbhd]], ~r/layout/},
      {[q, q, q, [scale: :big]], ~r/scale/},
      {[{<<1, 2, 3>>, {1, 4, 2, 8}, f}, q, q, []], ~r/^q: binary has 3 bytes/}
    ]

    for {[q, k, v, opts], re} <- cases do
      assert_raise ArgumentError, re, fn ->
        FlashAttention.native(q, k, v, [backend: :cpu] ++ opts)
      end
    end
  end

  @tag :cuda
  test "cuda matches the f64 reference for every type, tensor-core and FFMA head dims" do
    for type <- [{:f, 32}, {:f, 16}, {:bf, 16}], d <- [16, 40, 64, 33] do
      check(:cuda, type, d)
    end
  end

  @tag :cuda
  test "cuda with device buffers in and out agrees with host tensors" do
    shape = {1, 60, 4, 64}
    [q, k, v] = for _ <- 1..3, do: FusedKernels.Sample.random_triple(shape, {:bf, 16})
    host = FlashAttention.native(q, k, v, backend: :cuda, causal: true)
    [qb, kb, vb] = Enum.map([q, k, v], &FusedKernels.Buffer.upload/1)

    {out, lse} =
      FlashAttention.native(qb, kb, vb,
        backend: :cuda,
        causal: true,
        out: :device,
        return_lse: true
      )

    assert %FusedKernels.Buffer{shape: ^shape} = out
    assert %FusedKernels.Buffer{shape: {1, 4, 60}, type: {:f, 32}} = lse
    assert FusedKernels.Buffer.download(out) == host
  end

  if Code.ensure_loaded?(Nx) do
    defp nx_runner(backend) do
      fn q, k, v, opts ->
        to_nx = fn {bin, s, t} -> bin |> Nx.from_binary(t) |> Nx.reshape(s) end
        from_nx = fn t -> {Nx.to_binary(t), Nx.shape(t), Nx.type(t)} end

        {out, lse} =
          FusedKernels.flash_attention(
            to_nx.(q),
            to_nx.(k),
            to_nx.(v),
            Keyword.put(opts, :backend, backend)
          )

        {from_nx.(out), from_nx.(lse)}
      end
    end

    @tag :nx
    test "pure Nx matches the f64 reference" do
      for type <- [{:f, 32}, {:bf, 16}], d <- [5, 16], do: check(:nx, type, d, nx_runner(:nx))
    end

    @tag :nx
    test "through Nx tensors the native backends match too" do
      check(:cpu, {:f, 32}, 8, nx_runner(:cpu))
      if FusedKernels.Backend.cuda_available?(), do: check(:cuda, {:f, 32}, 8, nx_runner(:cuda))
    end

    @tag :nx
    test "inside defn the :auto backend takes the pure-Nx path" do
      shape = {1, 7, 2, 8}
      [q, k, v] = for _ <- 1..3, do: Nx.iota(shape, type: {:f, 32}) |> Nx.divide(50) |> Nx.sin()

      fun =
        Nx.Defn.jit(&FusedKernels.flash_attention(&1, &2, &3, causal: true),
          compiler: Nx.Defn.Evaluator
        )

      out = fun.(q, k, v)
      expected = FlashAttention.nx(q, k, v, causal: true)
      assert Nx.to_flat_list(out) == Nx.to_flat_list(expected)

      {cpu, _, _} =
        FlashAttention.native(
          {Nx.to_binary(q), shape, {:f, 32}},
          {Nx.to_binary(k), shape, {:f, 32}},
          {Nx.to_binary(v), shape, {:f, 32}},
          backend: :cpu,
          causal: true
        )

      err = TestRef.rel_l2(TestRef.decode(cpu, {:f, 32}), Nx.to_flat_list(out))
      assert err <= 1.0e-6
    end

    @tag :nx
    test "pure Nx refuses bad shapes with ArgumentError" do
      q = Nx.iota({1, 4, 3, 8}, type: {:f, 32})
      k = Nx.iota({1, 4, 2, 8}, type: {:f, 32})

      assert_raise ArgumentError, ~r/multiple/, fn ->
        FusedKernels.flash_attention(q, k, k, backend: :nx)
      end
    end
  end
end
