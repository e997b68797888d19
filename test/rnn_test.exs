defmodule FusedKernels.RnnTest do
  # LSTM/GRU: native backends against the pure-Nx path (Axon's equations), pure Nx against
  # Axon itself (:axon), and argument errors. The f64 reference matrix is in the Rust tests
  # (native/fused_kernels_core/src/ops/rnn/tests.rs), the full one on the GPU.
  use ExUnit.Case, async: true

  alias FusedKernels.{Rnn, TestRef}

  @names %{
    lstm: {~w(wii wif wig wio), ~w(whi whf whg who), ~w(bi bf bg bo)},
    gru: {~w(wir wiz win), ~w(whr whz whn), ~w(br bz bin bhn)}
  }

  defp triple(shape, type, scale) do
    values = for v <- TestRef.random_list(Tuple.product(shape)), do: v * scale
    {TestRef.encode(values, type), shape, type}
  end

  def params(cell, inp, h, type) do
    {ins, hids, bs} = @names[cell]

    %{
      "input_kernel" => Map.new(ins, &{&1, triple({inp, h}, type, 0.3 / :math.sqrt(inp))}),
      "hidden_kernel" => Map.new(hids, &{&1, triple({h, h}, type, 0.3 / :math.sqrt(h))}),
      "bias" => Map.new(bs, &{&1, triple({h}, type, 0.2)})
    }
  end

  test "argument errors name the parameter (no Nx needed)" do
    p = params(:lstm, 4, 5, {:f, 32})
    x = triple({2, 3, 4}, {:f, 32}, 1.0)
    assert {_seq, [{_c, _h}]} = Rnn.native(:lstm, x, [p], backend: :cpu)

    assert_raise ArgumentError, ~r/params\["input_kernel"\] is missing "wif"/, fn ->
      Rnn.native(:lstm, x, [update_in(p, ["input_kernel"], &Map.delete(&1, "wif"))], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/params is missing "bias"/, fn ->
      Rnn.native(:lstm, x, [Map.delete(p, "bias")], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/"hidden_kernel" "whg" must have shape \{5, 5\}/, fn ->
      bad = put_in(p, ["hidden_kernel", "whg"], triple({4, 5}, {:f, 32}, 1.0))
      Rnn.native(:lstm, x, [bad], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/"bias" "bo" has type bf16/, fn ->
      bad = put_in(p, ["bias", "bo"], triple({5}, {:bf, 16}, 1.0))
      Rnn.native(:lstm, x, [bad], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/"initial_state" "h" must have shape \{2, 5\}/, fn ->
      st = {triple({2, 5}, {:f, 32}, 1.0), triple({3, 5}, {:f, 32}, 1.0)}
      Rnn.native(:lstm, x, [p], backend: :cpu, initial_state: [st])
    end

    assert_raise ArgumentError, ~r/initial_state must be \{h\}/, fn ->
      Rnn.native(:gru, x, [params(:gru, 4, 5, {:f, 32})], backend: :cpu, initial_state: [{1, 2}])
    end

    assert_raise ArgumentError, ~r/^x: expected a 3-D/, fn ->
      Rnn.native(:lstm, triple({6, 4}, {:f, 32}, 1.0), [p], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/reverse must be a boolean/, fn ->
      Rnn.native(:lstm, x, [p], backend: :cpu, reverse: 1)
    end
  end

  test "prepared weights give the unprepared call's outputs, bit for bit (no Nx needed)" do
    for cell <- [:lstm, :gru],
        type <- [{:f, 32}, {:bf, 16}],
        reverse <- [false, true],
        {b, t, i, hs} <- [{1, 1, 7, [200]}, {2, 61, 6, [5, 4]}, {3, 100, 9, [16, 24, 8]}] do
      ps = Enum.zip([i | hs], hs) |> Enum.map(fn {inp, h} -> params(cell, inp, h, type) end)
      x = triple({b, t, i}, type, 1.0)

      st =
        for h <- hs,
            do:
              if(cell == :lstm,
                do: {triple({b, h}, type, 0.5), triple({b, h}, type, 0.5)},
                else: {triple({b, h}, type, 0.5)}
              )

      prepared = Rnn.prepare(cell, ps, backend: :cpu)
      assert is_reference(prepared.ref)

      for opts <- [[], [initial_state: st]] do
        opts = [backend: :cpu, reverse: reverse] ++ opts
        want = Rnn.native(cell, x, ps, opts)
        # Twice: the second call reuses the handle's scratch.
        assert Rnn.native(cell, x, prepared, opts) == want
        assert Rnn.native(cell, x, prepared, opts) == want
      end
    end
  end

  # native/fused_kernels_nif/src/ops/rnn.rs `is_short`: a handle's first call is queued on the
  # job lanes (the NIF answers a reference, the reply follows); once a call computed within
  # jobs::SHORT_WINDOW_NS, the next continues on a dirty scheduler (the NIF answers the reply).
  test "a prepared call runs on the job lanes first, then on a dirty scheduler when short" do
    p = params(:lstm, 9, 16, {:f, 32})
    prepared = Rnn.prepare(:lstm, [p], backend: :cpu)

    args = [
      %{params: prepared.ref, x: triple({2, 5, 9}, {:f, 32}, 1.0), initial_state: []},
      %{reverse: false}
    ]

    assert {:lanes, first} = TestRef.cpu_route(:rnn_prepared, args)
    assert {:dirty, second} = TestRef.cpu_route(:rnn_prepared, args)
    assert {:ok, _} = first
    assert second == first
  end

  test "a prepared handle of the wrong kind, backend or size raises ArgumentError naming it" do
    p = params(:lstm, 4, 5, {:f, 32})
    x = triple({2, 3, 4}, {:f, 32}, 1.0)
    prepared = Rnn.prepare(:lstm, [p], backend: :cpu)

    assert_raise ArgumentError, ~r/^params: prepared for :lstm, called as :gru/, fn ->
      Rnn.native(:gru, x, prepared, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^x: has 6 features but the prepared params take 4/, fn ->
      Rnn.native(:lstm, triple({2, 3, 6}, {:f, 32}, 1.0), prepared, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/^x: has type bf16 but the params were prepared as f32/, fn ->
      Rnn.native(:lstm, triple({2, 3, 4}, {:bf, 16}, 1.0), prepared, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/"initial_state" "h" must be \{2, 5\}/, fn ->
      st = {triple({2, 5}, {:f, 32}, 1.0), triple({3, 5}, {:f, 32}, 1.0)}
      Rnn.native(:lstm, x, prepared, backend: :cpu, initial_state: [st])
    end

    assert_raise ArgumentError, ~r/initial_state: expected one state per layer \(1\)/, fn ->
      Rnn.native(:lstm, x, prepared, backend: :cpu, initial_state: [nil, nil])
    end

    assert_raise ArgumentError, ~r/^params: expected weights from FusedKernels.Rnn.prepare/, fn ->
      %{params: make_ref(), x: x, initial_state: []}
      |> FusedKernels.Native.rnn_prepared(%{reverse: false})
      |> FusedKernels.Native.unwrap!()
    end

    assert_raise ArgumentError, ~r/^params: already prepared/, fn ->
      Rnn.prepare(:lstm, prepared)
    end

    assert_raise ArgumentError, ~r/params\["bias"\] is missing "bo"/, fn ->
      Rnn.prepare(:lstm, [update_in(p, ["bias"], &Map.delete(&1, "bo"))], backend: :cpu)
    end

    assert_raise ArgumentError, ~r/"hidden_kernel" "whg" must have shape \{5, 5\}/, fn ->
      bad = put_in(p, ["hidden_kernel", "whg"], triple({4, 5}, {:f, 32}, 1.0))
      Rnn.prepare(:lstm, [bad], backend: :cpu)
    end

    if FusedKernels.Backend.cuda_available?() do
      assert_raise ArgumentError,
                   ~r/^params: prepared for backend :cpu, the call asks for :cuda/,
                   fn ->
                     Rnn.native(:lstm, x, prepared, backend: :cuda)
                   end
    end

    # f64 weights keep the params (the prepared CPU path is f32) and answer as unprepared.
    p64 = params(:gru, 4, 5, {:f, 64})
    x64 = triple({2, 3, 4}, {:f, 64}, 1.0)
    prepared64 = Rnn.prepare(:gru, [p64], backend: :cpu)
    assert prepared64.ref == nil

    assert Rnn.native(:gru, x64, prepared64, backend: :cpu) ==
             Rnn.native(:gru, x64, [p64], backend: :cpu)
  end

  test "precision: :tf32 is validated and leaves the CPU path f32-accurate" do
    p = params(:gru, 4, 5, {:f, 32})
    x = triple({2, 3, 4}, {:f, 32}, 1.0)
    {{bin, _, _}, _} = Rnn.native(:gru, x, [p], backend: :cpu)
    assert {{^bin, _, _}, _} = Rnn.native(:gru, x, [p], backend: :cpu, precision: :tf32)

    assert_raise ArgumentError, ~r/precision must be :f32 or :tf32/, fn ->
      Rnn.native(:gru, x, [p], backend: :cpu, precision: :bf16)
    end
  end

  @tag :cuda
  test "precision: :tf32 on the CUDA large-batch path stays within TF32's 1e-3 of f32" do
    for cell <- [:lstm, :gru] do
      layers = [params(cell, 48, 256, {:f, 32}), params(cell, 256, 256, {:f, 32})]
      x = triple({64, 9, 48}, {:f, 32}, 1.0)
      {{ref, _, t}, _} = Rnn.native(cell, x, layers, backend: :cuda)
      {{got, _, ^t}, _} = Rnn.native(cell, x, layers, backend: :cuda, precision: :tf32)

      err = TestRef.rel_l2(TestRef.decode(got, t), TestRef.decode(ref, t))
      assert err <= 1.0e-3, "#{cell}: rel L2 #{err}"
      assert err > 0.0, "#{cell}: tf32 gave the f32 result bit for bit: not taken"
    end
  end

  if Code.ensure_loaded?(Nx) do
    defp to_nx_params(p),
      do:
        Map.new(p, fn {k, m} ->
          {k, Map.new(m, fn {n, t} -> {n, FusedKernels.Tensor.to_nx(t)} end)}
        end)

    defp rel(a, b) do
      a = Nx.as_type(a, {:f, 64})
      b = Nx.as_type(b, {:f, 64})

      Nx.to_number(
        Nx.divide(Nx.sqrt(Nx.sum(Nx.pow(Nx.subtract(a, b), 2))), Nx.sqrt(Nx.sum(Nx.pow(b, 2))))
      )
    end

    defp states_of(:lstm, b, h, type), do: {rand_t({b, h}, type), rand_t({b, h}, type)}
    defp states_of(:gru, b, h, type), do: {rand_t({b, h}, type)}
    defp rand_t(shape, type), do: triple(shape, type, 0.5) |> FusedKernels.Tensor.to_nx()

    @tag :nx
    test "native backends agree with the pure-Nx path (stacks, reverse, initial state)" do
      backends = if FusedKernels.Backend.cuda_available?(), do: [:cpu, :cuda], else: [:cpu]

      for cell <- [:lstm, :gru],
          type <- [{:f, 32}, {:bf, 16}],
          reverse <- [false, true],
          backend <- backends do
        {b, t, i, hs} = {3, 7, 6, [5, 4]}
        x = rand_t({b, t, i}, type)

        ps =
          Enum.zip([i | hs], hs)
          |> Enum.map(fn {inp, h} -> to_nx_params(params(cell, inp, h, type)) end)

        st = Enum.map(hs, &states_of(cell, b, &1, type))
        fun = if cell == :lstm, do: &FusedKernels.lstm_stack/3, else: &FusedKernels.gru_stack/3
        {ref_seq, ref_states} = fun.(x, ps, backend: :nx, reverse: reverse, initial_state: st)
        {seq, states} = fun.(x, ps, backend: backend, reverse: reverse, initial_state: st)
        tol = TestRef.tolerance(type)
        assert rel(seq, ref_seq) <= tol, "#{cell} #{inspect(type)} #{backend} reverse=#{reverse}"

        for {s, r} <- Enum.zip(states, ref_states),
            {a, e} <- Enum.zip(Tuple.to_list(s), Tuple.to_list(r)),
            do: assert(rel(a, e) <= tol)
      end
    end

    @tag :nx
    test "prepared params answer as the plain ones on every backend, one layer and stacks" do
      backends = [:nx, :cpu] ++ if(FusedKernels.Backend.cuda_available?(), do: [:cuda], else: [])

      for cell <- [:lstm, :gru], backend <- backends, reverse <- [false, true] do
        {b, t, i, hs} = {2, 9, 6, [128, 64]}
        x = rand_t({b, t, i}, {:f, 32})

        ps =
          Enum.zip([i | hs], hs)
          |> Enum.map(fn {inp, h} -> to_nx_params(params(cell, inp, h, {:f, 32})) end)

        st = Enum.map(hs, &states_of(cell, b, &1, {:f, 32}))
        opts = [backend: backend, reverse: reverse, initial_state: st]

        {stack, one} =
          if cell == :lstm,
            do: {&FusedKernels.lstm_stack/3, &FusedKernels.lstm/3},
            else: {&FusedKernels.gru_stack/3, &FusedKernels.gru/3}

        prepared = Rnn.prepare(cell, ps, backend: backend)
        assert prepared.backend == backend and is_reference(prepared.ref) == (backend == :cpu)
        {seq, states} = stack.(x, ps, opts)
        {pseq, pstates} = stack.(x, prepared, opts)
        # Bit for bit: the same kernels run on the same values.
        assert Nx.to_binary(pseq) == Nx.to_binary(seq), "#{cell} #{backend} reverse=#{reverse}"

        for {s1, s2} <- Enum.zip(states, pstates),
            {a, e} <- Enum.zip(Tuple.to_list(s1), Tuple.to_list(s2)),
            do: assert(Nx.to_binary(a) == Nx.to_binary(e))

        one_opts = Keyword.put(opts, :initial_state, hd(st))
        p1 = Rnn.prepare(cell, hd(ps), backend: backend)
        {seq1, st1} = one.(x, hd(ps), one_opts)
        {pseq1, pst1} = one.(x, p1, one_opts)
        assert Nx.to_binary(pseq1) == Nx.to_binary(seq1)

        assert Enum.map(Tuple.to_list(pst1), &Nx.to_binary/1) ==
                 Enum.map(Tuple.to_list(st1), &Nx.to_binary/1)

        assert_raise ArgumentError, ~r/params: prepared for a stack of 2 layers/, fn ->
          one.(x, prepared, backend: backend)
        end
      end

      # Prepared on :nx, it also runs inside defn.
      x = rand_t({2, 4, 3}, {:f, 32})
      p = to_nx_params(params(:gru, 3, 5, {:f, 32}))
      prepared = Rnn.prepare(:gru, p, backend: :nx)
      f = Nx.Defn.jit(fn x -> FusedKernels.gru(x, prepared) end)
      {seq, {h}} = f.(x)
      {want_seq, {want_h}} = FusedKernels.gru(x, p, backend: :nx)
      assert rel(seq, want_seq) <= 1.0e-6 and rel(h, want_h) <= 1.0e-6
    end

    @tag :nx
    test "lstm/3 and gru/3 return Axon's shapes and work inside defn" do
      x = rand_t({2, 4, 3}, {:f, 32})
      p = to_nx_params(params(:gru, 3, 5, {:f, 32}))
      assert {seq, {h}} = FusedKernels.gru(x, p)
      assert Nx.shape(seq) == {2, 4, 5} and Nx.shape(h) == {2, 5}
      f = Nx.Defn.jit(fn x, p -> FusedKernels.gru(x, p) end)
      {seq2, {h2}} = f.(x, p)
      assert rel(seq2, seq) <= 1.0e-5 and rel(h2, h) <= 1.0e-5
    end

    if Code.ensure_loaded?(Axon) do
      @tag :axon
      test "pure Nx and the native CPU path match Axon.lstm / Axon.gru given the same params and state" do
        for cell <- [:lstm, :gru] do
          {b, t, i, h} = {2, 6, 5, 7}
          x = rand_t({b, t, i}, {:f, 32})
          st = states_of(cell, b, h, {:f, 32})
          p = to_nx_params(params(cell, i, h, {:f, 32}))
          input = Axon.input("x", shape: {nil, t, i})

          {model, state_inputs} =
            case cell do
              :lstm ->
                c0 = Axon.input("c", shape: {nil, h})
                h0 = Axon.input("h", shape: {nil, h})

                {Axon.lstm(input, {c0, h0}, h, name: "rnn"),
                 %{"c" => elem(st, 0), "h" => elem(st, 1)}}

              :gru ->
                h0 = Axon.input("h", shape: {nil, h})
                {Axon.gru(input, {h0}, h, name: "rnn"), %{"h" => elem(st, 0)}}
            end

          {_init, predict} = Axon.build(Axon.container(model))
          {a_seq, a_state} = predict.(%{"rnn" => p}, Map.put(state_inputs, "x", x))
          fun = if cell == :lstm, do: &FusedKernels.lstm/3, else: &FusedKernels.gru/3

          for backend <- [:nx, :cpu] do
            {seq, state} = fun.(x, p, backend: backend, initial_state: st)
            assert rel(seq, a_seq) <= 1.0e-5, "#{cell} #{backend}"

            for {a, e} <- Enum.zip(Tuple.to_list(state), Tuple.to_list(a_state)),
                do: assert(rel(a, e) <= 1.0e-5, "#{cell} #{backend} state")
          end
        end
      end
    end
  end
end
