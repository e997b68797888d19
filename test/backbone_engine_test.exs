defmodule FusedKernels.BackboneEngineTest do
  # The native engine behind Backbone on :cpu: one NIF call per window and per frame, the
  # state a resource advanced in place, batch rows independent, and the API's argument
  # errors. (Engine vs composed ops: native/fused_kernels_core/tests/engine_cpu.rs; vs the
  # pure-Nx path and Axon: the :nx tests below and backbone_axon_test.exs.)
  use ExUnit.Case, async: false
  import Bitwise

  alias FusedKernels.{Backbone, Native, Sample, TestRef}
  alias FusedKernels.Backbone.Spec

  defp frame({bin, {b, t, e}, type}, i) do
    rows = for r <- 0..(b - 1), into: <<>>, do: binary_part(bin, (r * t + i) * e * 4, e * 4)
    {rows, {b, e}, type}
  end

  defp row({bin, {_b, t, e}, type}, r),
    do: {binary_part(bin, r * t * e * 4, t * e * 4), {1, t, e}, type}

  defp assert_close({a, shape, type}, {b, shape, type}, tol) do
    err = TestRef.rel_l2(TestRef.decode(a, type), TestRef.decode(b, type))
    assert err <= tol, "rel L2 #{err}"
  end

  # Calls into FusedKernels.Native (NIFs only, not its Elixir helpers) while `fun` runs,
  # seen by a tracer process.
  defp nif_calls(fun) do
    helpers = [:unwrap!, :status, :loaded?, :load_nif, :__info__, :module_info]
    tracer = spawn_link(fn -> trace_loop([]) end)
    :erlang.trace_pattern({Native, :_, :_}, true, [:local])
    :erlang.trace(self(), true, [:call, {:tracer, tracer}])

    try do
      fun.()
    after
      :erlang.trace(self(), false, [:call])
      :erlang.trace_pattern({Native, :_, :_}, false, [:local])
    end

    send(tracer, {:done, self()})
    assert_receive {:calls, calls}, 5_000
    for {Native, f, _} <- calls, f not in helpers, do: f
  end

  defp trace_loop(acc) do
    receive do
      {:trace, _, :call, mfa} -> trace_loop([mfa | acc])
      {:done, from} -> send(from, {:calls, Enum.reverse(acc)})
    end
  end

  defp small(kind), do: Spec.new(kind, embed: 24, hidden: 32, heads: 2, head_dim: 16, window: 16)

  for kind <- Spec.kinds(), backend <- [:cpu, :cuda] do
    if backend == :cuda, do: @tag(:cuda)

    test "#{kind} on #{backend}: one NIF call per predict and per step" do
      spec = small(unquote(kind))
      h = Backbone.load(spec, Backbone.random_params(spec, 1), backend: unquote(backend))
      win = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
      state = Backbone.init_state(h, 1)
      Backbone.predict(h, win)
      Backbone.step(h, state, frame(win, 0))

      assert nif_calls(fn -> Backbone.predict(h, win) end) == [:engine_predict]
      assert nif_calls(fn -> Backbone.step(h, state, frame(win, 1)) end) == [:engine_step]
    end

    if backend == :cuda, do: @tag(:cuda)

    test "#{kind} on #{backend}: batch-8 rows equal eight batch-1 calls, streamed too" do
      spec = small(unquote(kind))
      h = Backbone.load(spec, Backbone.random_params(spec, 2), backend: unquote(backend))
      win = Sample.random_triple({8, 11, spec.embed}, {:f, 32})
      {all, {8, 32}, _} = Backbone.predict(h, win)

      for r <- 0..7 do
        {one, {1, 32}, _} = Backbone.predict(h, row(win, r))

        # The GPU may pick another kernel path per batch size (f32-accurate either way).
        assert_close(
          {binary_part(all, r * 32 * 4, 32 * 4), {1, 32}, {:f, 32}},
          {one, {1, 32}, {:f, 32}},
          if(unquote(backend) == :cpu, do: 1.0e-6, else: 1.0e-5)
        )
      end

      state = Backbone.init_state(h, 8)

      {streamed, ^state} =
        Enum.reduce(0..10, {nil, state}, fn i, {_, s} -> Backbone.step(h, s, frame(win, i)) end)

      assert_close(streamed, {all, {8, 32}, {:f, 32}}, 1.0e-5)
      # reset/2 starts the same stream over.
      ^state = Backbone.reset(h, state)
      {first, _} = Backbone.step(h, state, frame(win, 0))
      h2 = Backbone.load(spec, Backbone.random_params(spec, 2), backend: unquote(backend))
      {fresh, _} = Backbone.step(h2, Backbone.init_state(h2, 8), frame(win, 0))
      assert first == fresh
    end
  end

  # native/fused_kernels_nif/src/engine.rs `cpu_window_is_short`: a CPU engine's first window
  # is queued on the job lanes (the NIF answers a reference, the reply follows); once a window
  # computed within jobs::SHORT_WINDOW_NS, the next continues on a dirty scheduler (the NIF
  # answers the reply itself).
  test "a CPU engine's window runs on the job lanes first, then on a dirty scheduler" do
    spec = small(:lstm)
    h = Backbone.load(spec, Backbone.random_params(spec, 4), backend: :cpu)
    win = Sample.random_triple({2, 16, spec.embed}, {:f, 32})
    predict = fn -> Native.engine_predict(%{engine: h.engine, window: win}, %{}) end

    assert {:lanes, {:ok, first}} = TestRef.route(predict)
    assert {:dirty, {:ok, ^first}} = TestRef.route(predict)
  end

  test "ExPhil's 1-layer GRU, windows 16 and 60, streams like its window" do
    for window <- [16, 60] do
      spec = Spec.new(:gru, layers: 1, window: window)
      h = Backbone.load(spec, Backbone.random_params(spec, 3), backend: :cpu)
      win = Sample.random_triple({1, window, spec.embed}, {:f, 32})
      full = Backbone.predict(h, win)
      assert {_, {1, 256}, {:f, 32}} = full

      {streamed, _} =
        Enum.reduce(0..(window - 1), {nil, Backbone.init_state(h, 1)}, fn i, {_, s} ->
          Backbone.step(h, s, frame(win, i))
        end)

      assert_close(streamed, full, 1.0e-5)
    end
  end

  describe "argument errors" do
    setup do
      spec = small(:gru)
      params = Backbone.random_params(spec, 4)
      %{spec: spec, params: params, h: Backbone.load(spec, params, backend: :cpu)}
    end

    test "load", %{spec: spec, params: params} do
      assert_raise ArgumentError, ~r/params must be a map/, fn -> Backbone.load(spec, []) end

      assert_raise ArgumentError, ~r/opts must be a keyword list/, fn ->
        Backbone.load(spec, params, %{backend: :cpu})
      end

      assert_raise ArgumentError, ~r/spec must be/, fn -> Backbone.load(:gru, params) end

      junk = put_in(params, ["rnn_1", "bias", "br"], "junk")
      assert_raise ArgumentError, fn -> Backbone.load(spec, junk, backend: :cpu) end

      assert_raise ArgumentError, ~r/params: expected tensors/, fn ->
        Backbone.load(spec, junk, backend: :nx)
      end

      short = put_in(params, ["rnn_1", "bias", "br"], {<<0::32>>, {1}, {:f, 32}})

      assert_raise ArgumentError, ~r/rnn_1\/bias\/br/, fn ->
        Backbone.load(spec, short, backend: :cpu)
      end

      state = %{__struct__: Axon.ModelState, data: params}
      assert %Backbone{} = Backbone.load(spec, state, backend: :cpu)
    end

    test "init_state and step", %{spec: spec, params: params, h: h} do
      assert_raise ArgumentError, ~r/batch must be a positive integer/, fn ->
        Backbone.init_state(h, 0)
      end

      assert_raise ArgumentError, ~r/batch must be a positive integer/, fn ->
        Backbone.init_state(h, :one)
      end

      f = Sample.random_triple({1, spec.embed}, {:f, 32})

      for bad <- [[], [{nil}], %{count: 0, layers: []}, nil] do
        assert_raise ArgumentError, ~r/state: expected the state init_state/, fn ->
          Backbone.step(h, bad, f)
        end
      end

      other = Backbone.load(spec, params, backend: :cpu)
      foreign = Backbone.init_state(other, 1)
      assert_raise ArgumentError, ~r/another backbone/, fn -> Backbone.step(h, foreign, f) end

      state = Backbone.init_state(h, 2)
      assert_raise ArgumentError, ~r/batch 2/, fn -> Backbone.step(h, state, f) end

      assert_raise ArgumentError, ~r/frame: expected/, fn ->
        Backbone.step(h, state, Sample.random_triple({2, 1, spec.embed}, {:f, 32}))
      end
    end

    test "rank-2 windows and wrong embed", %{spec: spec} do
      for kind <- Spec.kinds() do
        s = small(kind)
        h = Backbone.load(s, Backbone.random_params(s, 5), backend: :cpu)

        assert_raise ArgumentError, ~r/window: expected/, fn ->
          Backbone.predict(h, Sample.random_triple({1, s.embed}, {:f, 32}))
        end

        assert_raise ArgumentError, ~r/window: expected/, fn ->
          Backbone.predict(h, Sample.random_triple({1, 4, s.embed + 1}, {:f, 32}))
        end
      end

      _ = spec
    end

    test "the :nx path checks state and rank too" do
      # The :nx path takes list/map states; truncated ones are refused before any layer runs.
      spec = small(:lstm)
      h = %Backbone{spec: spec, backend: :nx, device: nil, weights: %{}}
      f = Sample.random_triple({1, spec.embed}, {:f, 32})
      assert_raise ArgumentError, ~r/state: expected/, fn -> Backbone.step(h, [{f, f}], f) end
      assert_raise ArgumentError, ~r/window: expected/, fn -> Backbone.predict(h, f) end

      spec = small(:jamba)
      h = %Backbone{spec: spec, backend: :nx, device: nil, weights: %{}}

      assert_raise ArgumentError, ~r/state: expected/, fn ->
        Backbone.step(h, %{count: 0, layers: [{:mamba, f, f}]}, f)
      end
    end
  end

  test "the engine NIFs answer junk with error tuples" do
    spec = small(:jamba)
    h = Backbone.load(spec, Backbone.random_params(spec, 7), backend: :cpu)
    state = Backbone.init_state(h, 2)
    win = Sample.random_triple({2, 3, spec.embed}, {:f, 32})
    map = Map.from_struct(spec)

    junk = [
      nil,
      :atom,
      -1,
      1.5,
      make_ref(),
      self(),
      "bin",
      [1 | 2],
      {<<0::32>>, {1, 2, 3}, {:f, 32}},
      {<<>>, {0, 0, 288}, {:f, 32}},
      {win |> elem(0), {2, 3, spec.embed}, {:s, 32}},
      %{map | hidden: -3},
      %{map | kind: :nope},
      %{map | window: 1 <<< 40},
      [{"input_proj/kernel", 5}],
      123_456_789_012_345_678_901_234_567_890
    ]

    load = %{spec: map, backend: :cpu, device: nil}
    step = %{engine: h.engine, state: state.ref, frame: frame(win, 0)}

    calls = [
      fn j -> Native.engine_load(%{params: []}, %{load | spec: j}) end,
      fn j -> Native.engine_load(%{params: j}, load) end,
      fn j -> Native.engine_load(%{params: []}, %{load | backend: j}) end,
      fn j -> Native.engine_load(%{params: []}, %{load | device: j}) end,
      fn j -> Native.engine_load(j, load) end,
      fn j -> Native.engine_load(%{params: []}, j) end,
      fn j -> Native.engine_predict(%{engine: j, window: win}, %{}) end,
      fn j -> Native.engine_predict(%{engine: h.engine, window: j}, %{}) end,
      fn j -> Native.engine_predict(%{engine: h.engine, window: win}, j) end,
      fn j -> Native.engine_init_state(%{engine: h.engine}, %{batch: j}) end,
      fn j -> Native.engine_init_state(%{engine: j}, %{batch: 1}) end,
      fn j -> Native.engine_step(%{step | state: j}, %{}) end,
      fn j -> Native.engine_step(%{step | frame: j}, %{}) end,
      fn j -> Native.engine_step(%{step | engine: j}, %{}) end,
      fn j -> Native.engine_step(j, %{}) end,
      fn j -> Native.engine_reset(%{engine: h.engine, state: j}, %{}) end,
      fn j -> Native.engine_reset(%{engine: j, state: state.ref}, %{}) end,
      fn j -> Native.engine_state_info(%{state: j}, %{}) end,
      fn j -> Native.engine_graphs(%{engine: j}, %{}) end
    ]

    for call <- calls, j <- junk do
      assert {:error, {kind, msg}} = call.(j)
      assert kind in [:argument, :out_of_memory, :unavailable] and is_binary(msg)
    end

    # The engine still answers.
    assert {_, {2, 32}, {:f, 32}} = Backbone.predict(h, win)
  end

  for kind <- Spec.kinds() do
    @tag :nx
    @tag timeout: 600_000
    test "#{kind}: the engine equals the pure-Nx path on the same params" do
      # Longer than the attention window (16), so the sliding window cuts in; Nx's binary
      # backend is slow, so the sizes stay small.
      spec = small(unquote(kind))
      params = Backbone.random_params(spec, 6)
      win = Sample.random_triple({2, 19, spec.embed}, {:f, 32})
      native = Backbone.predict(Backbone.load(spec, params, backend: :cpu), win)

      nx =
        Backbone.predict(
          Backbone.load(spec, params, backend: :nx),
          apply(FusedKernels.Tensor, :to_nx, [win])
        )

      assert_close(native, FusedKernels.Tensor.to_native(nx), 1.0e-5)
    end
  end
end
