defmodule FusedKernels.NifFuzz do
  @moduledoc """
  A seeded fuzz over every NIF of `FusedKernels.Native`.

  Call `i` of run `seed` on a backend (`:cpu` or `:cuda`) is generated from `{seed, i}` alone:
  a valid call of one NIF (small random shapes and values), then with probability 2/3 one to
  three junk mutations: an argument, or one field of an argument map (the typed `inputs` and
  `options` maps), replaced by junk (improper lists, bignums, huge or negative shapes, wrong
  types, refs and pids that are not our resources, NaN-like options, tensors of the wrong
  size), a field dropped, or an unknown field added. So any call replays on its own, in any
  order and from any process: `one_line/3` prints it as one Elixir expression, and
  `test/fuzz.exs` bisects a crashing run and shrinks the call.

  On `:cuda` the valid calls use f32/f16/bf16 (f64 is CPU-only), half of their tensors are
  uploaded as device buffers and half of them ask for `out: :device`.

  The contract checked: every call returns `{:ok, _}` or `{:error, {kind, message}}` with a
  known kind and a binary message (so `Native.unwrap!/1` raises only `ArgumentError` or
  `FusedKernels.Error`); anything else (a raise, `:nif_panicked`, a bad shape of reply) is a
  failure. A VM death shows as the run never finishing; `test/fuzz.exs` finds the call. A
  valid call refused on `:cpu` is a failure; on `:cuda` it is counted apart (`refused`), with
  its message, since the GPU paths have limits of their own.
  """

  import Bitwise
  alias FusedKernels.Native

  @cpu_ops ~w(scaled_softmax dense dense_prepare dense_prepared flash_attention rnn rnn_prepare
              rnn_prepared selective_scan norm mamba_block stream_shift_append stream_reshape
              mamba_block_state engine_load engine_predict engine_init_state engine_step
              engine_reset engine_state_info engine_graphs)a
  @kinds [:argument, :unavailable, :out_of_memory, :compile, :cuda, :nif_not_loaded]

  @doc "The NIFs this fuzz calls, by name."
  def nifs,
    do: ~w(scaled_softmax dense dense_prepare dense_prepared flash_attention rnn rnn_prepare
           rnn_prepared selective_scan norm mamba_block stream_shift_append stream_reshape
           mamba_block_state info buffer_upload buffer_download buffer_meta cuda_mem_info
           cuda_synchronize engine_load engine_predict engine_init_state engine_step
           engine_reset engine_state_info engine_graphs)a

  @doc """
  Call `i` of run `seed` on `backend`: `{nif, args, mutations}` (args with the mutations
  applied, minus the mutations whose indices are in `drop`).
  """
  def generate(seed, i, drop \\ [], backend \\ :cpu) do
    :rand.seed(:exsss, {seed, i, 0x5EED})
    Process.put(:fk_fuzz_backend, backend)
    nif = Enum.random(nifs())
    args = valid(nif)

    mutations =
      if :rand.uniform(3) == 1 do
        []
      else
        for _ <- 1..Enum.random(1..3), do: {Enum.random(slots(args)), mutation()}
      end

    kept = mutations |> Enum.with_index() |> Enum.reject(fn {_, k} -> k in drop end)
    args = Enum.reduce(kept, args, fn {m, _}, acc -> mutate(acc, m) end)
    {nif, args, Enum.map(kept, &elem(&1, 0))}
  end

  # The places a mutation can hit: a whole argument, or a field of an argument that is a map,
  # at any depth (a Mamba block's weights map inside its inputs), as `{position, path}`.
  defp slots(args) do
    args
    |> Enum.with_index()
    |> Enum.flat_map(fn {arg, pos} -> for path <- paths(arg), do: {pos, path} end)
  end

  defp paths(%{} = map) when not is_struct(map),
    do: [[] | for(k <- Enum.sort(Map.keys(map)), p <- paths(map[k]), do: [k | p])]

  defp paths(_leaf), do: [[]]

  defp mutation do
    case :rand.uniform(10) do
      1 -> :drop_field
      2 -> :extra_field
      _ -> {:junk, junk()}
    end
  end

  defp mutate(args, {{pos, path}, what}),
    do: List.update_at(args, pos, &mutate_at(&1, path, what))

  defp mutate_at(_arg, [], {:junk, value}), do: value
  defp mutate_at(%{} = map, [], _what) when not is_struct(map), do: Map.put(map, :bogus, 1)
  defp mutate_at(arg, [], _what), do: arg
  defp mutate_at(%{} = map, [key], :drop_field) when not is_struct(map), do: Map.delete(map, key)

  defp mutate_at(%{} = map, [_key], :extra_field) when not is_struct(map),
    do: Map.put(map, :bogus, 1)

  defp mutate_at(%{} = map, [key | rest], what) when is_map_key(map, key) and not is_struct(map),
    do: Map.put(map, key, mutate_at(map[key], rest, what))

  # An earlier mutation replaced or removed what this path led to.
  defp mutate_at(arg, _path, _what), do: arg

  @doc """
  Runs one call and checks the contract: `:ok`, `{:error_reply, kind}` or `{:bad, why}`.
  An unmutated call of a CPU op must succeed.
  """
  def check({nif, args, mutations}, backend \\ :cpu) do
    case {call(nif, args), mutations} do
      # An unmutated call of a CPU op is valid: refusing it is a failure too.
      {{:error_reply, kind, message}, []} when nif in @cpu_ops and backend == :cpu ->
        {:bad, "valid call refused (#{kind}): #{message}"}

      {{:error_reply, kind, message}, []} when nif in @cpu_ops ->
        {:refused, "#{kind}: #{message}"}

      {{:error_reply, kind, _}, _} ->
        {:error_reply, kind}

      {outcome, _} ->
        outcome
    end
  end

  defp call(nif, args) do
    try do
      Native |> apply(nif, args) |> job_reply(nif)
    rescue
      e -> {:bad, "raised #{inspect(e.__struct__)}: #{Exception.message(e)}"}
    catch
      kind, value -> {:bad, "#{kind}: #{inspect(value, limit: 20)}"}
    else
      {:ok, _} ->
        :ok

      {:error, {kind, message}} when kind in @kinds and is_binary(message) ->
        {:error_reply, kind, message}

      # info/1 answers with a map even without a GPU.
      %{cuda_available: _} when nif == :info ->
        :ok

      other ->
        {:bad, "unexpected reply #{inspect(other, limit: 10)}"}
    end
  end

  # The CPU engine's predict/step run on the job lanes: the NIF answers a reference and the
  # reply follows as `{ref, reply}` (it always comes; a missing one is a failure here).
  defp job_reply(ref, nif) when is_reference(ref) and nif in [:engine_predict, :engine_step] do
    receive do
      {^ref, reply} -> reply
    after
      60_000 -> {:no_job_reply, nif}
    end
  end

  defp job_reply(reply, _nif), do: reply

  @doc """
  Runs calls `from..to-1` of `seed` over `concurrency` processes; returns counts per outcome
  and the failures as `{i, why}`. `on_call.(i)` runs before each call (progress logging).
  """
  def run(seed, from, to, concurrency \\ 4, on_call \\ fn _ -> :ok end, backend \\ :cpu) do
    from..(to - 1)//1
    |> Task.async_stream(
      fn i ->
        on_call.(i)
        call = generate(seed, i, [], backend)
        {i, elem(call, 0), check(call, backend)}
      end,
      max_concurrency: concurrency,
      ordered: false,
      timeout: :infinity
    )
    |> Enum.reduce(%{calls: 0, ok: 0, errors: 0, failures: [], refused: [], ok_by_nif: %{}}, fn
      {:ok, {i, nif, outcome}}, acc ->
        acc = %{acc | calls: acc.calls + 1}

        case outcome do
          :ok ->
            %{acc | ok: acc.ok + 1, ok_by_nif: Map.update(acc.ok_by_nif, nif, 1, &(&1 + 1))}

          {:error_reply, _} ->
            %{acc | errors: acc.errors + 1}

          {:bad, why} ->
            %{acc | failures: [{i, why} | acc.failures]}

          {:refused, why} ->
            %{acc | errors: acc.errors + 1, refused: [{i, nif, why} | acc.refused]}
        end
    end)
  end

  @doc "Call `i` of `seed` on `backend` as one line of Elixir that replays it."
  def one_line(seed, i, drop \\ [], backend \\ :cpu) do
    {nif, args, _} = generate(seed, i, drop, backend)
    shown = Enum.map_join(args, ", ", &show/1)
    "FusedKernels.Native.#{nif}(#{shown})"
  end

  # Refs, pids and improper lists have no literal syntax; say how to make one instead.
  defp show(ref) when is_reference(ref), do: "make_ref()"
  defp show(pid) when is_pid(pid), do: "self()"

  defp show(list) when is_list(list), do: "[" <> show_items(list) <> "]"

  defp show(%{} = map) when not is_struct(map),
    do: "%{" <> Enum.map_join(map, ", ", fn {k, v} -> "#{show(k)} => #{show(v)}" end) <> "}"

  defp show(tuple) when is_tuple(tuple),
    do: "{" <> Enum.map_join(Tuple.to_list(tuple), ", ", &show/1) <> "}"

  defp show(other), do: inspect(other, limit: :infinity, printable_limit: :infinity)

  # The items of a list, proper or not (`[1, 2 | 3]`).
  defp show_items([]), do: ""
  defp show_items([h]), do: show(h)
  defp show_items([h | t]) when is_list(t), do: show(h) <> ", " <> show_items(t)
  defp show_items([h | t]), do: show(h) <> " | " <> show(t)

  # ------------------------------------------------------------------ valid calls

  defp dim(max \\ 6), do: Enum.random(1..max)
  defp backend, do: Process.get(:fk_fuzz_backend, :cpu)
  defp cuda?, do: backend() == :cuda

  # f64 is CPU-only.
  defp type do
    if cuda?(),
      do: Enum.random([{:f, 32}, {:f, 32}, {:f, 16}, {:bf, 16}]),
      else: Enum.random([{:f, 32}, {:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}])
  end

  defp tensor(shape, type \\ {:f, 32}) do
    n = shape |> Tuple.to_list() |> Enum.product()
    {encode(n, type), shape, type}
  end

  defp encode(n, {:f, bits}),
    do: for(_ <- 1..n//1, into: <<>>, do: <<:rand.uniform() * 2 - 1::float-size(bits)-native>>)

  defp encode(n, {:bf, 16}) do
    for _ <- 1..n//1, into: <<>> do
      <<hi::16, _::16>> = <<:rand.uniform() * 2 - 1::float-32-big>>
      <<hi::16-native>>
    end
  end

  defp maybe(t), do: if(:rand.uniform(2) == 1, do: t, else: nil)
  defp out, do: if(cuda?() and :rand.uniform(2) == 1, do: :device, else: :host)

  # The options every typed op takes, merged into its own.
  defp options(own), do: Map.merge(own, %{backend: backend(), device: nil, out: out()})

  # A typed op's inputs map; on :cuda, each tensor is a device buffer half of the time.
  defp inputs(map) do
    Map.new(map, fn
      {k, {bin, _, _} = t} when is_binary(bin) ->
        with true <- cuda?() and :rand.uniform(2) == 1,
             {:ok, buffer} <- Native.buffer_upload(t, nil) do
          {k, buffer}
        else
          # No GPU (a dry run of the :cuda fuzz): the host tensor stays.
          _ -> {k, t}
        end

      {k, %{} = nested} ->
        {k, inputs(nested)}

      other ->
        other
    end)
  end

  defp valid(:scaled_softmax) do
    shape = Enum.random([{dim(), dim(9)}, {dim(2), dim(2), dim(), dim(9)}])

    [
      inputs(%{x: tensor(shape, type())}),
      options(%{scale: :rand.uniform() * 2, causal: Enum.random([true, false])})
    ]
  end

  defp valid(:dense) do
    {m, k, n} = {dim(), dim(9), dim(9)}
    kind = Enum.random([:dense, :swiglu, :rms_norm_dense, :layer_norm_dense])
    up = if kind == :swiglu, do: tensor({k, n}), else: nil
    bias_up = if kind == :swiglu, do: maybe(tensor({n})), else: nil
    gamma = if kind in [:rms_norm_dense, :layer_norm_dense], do: tensor({k}), else: nil
    beta = if kind == :layer_norm_dense, do: tensor({k}), else: nil
    residual = if kind == :dense, do: maybe(tensor({m, n})), else: nil

    act =
      if kind == :swiglu,
        do: :none,
        else: activation()

    [
      inputs(%{
        x: tensor({m, k}),
        kernel: tensor({k, n}),
        kernel_up: up,
        bias: maybe(tensor({n})),
        bias_up: bias_up,
        gamma: gamma,
        beta: beta,
        residual: residual
      }),
      options(%{kind: kind, activation: act, eps: 1.0e-5})
    ]
  end

  defp valid(:dense_prepare) do
    {k, n} = {dim(9), dim(9)}
    [%{kernel: tensor({k, n}), bias: maybe(tensor({n}))}, %{}]
  end

  defp valid(:dense_prepared) do
    {m, k, n} = {dim(), dim(9), dim(9)}

    prepared =
      %{kernel: tensor({k, n}), bias: maybe(tensor({n}))}
      |> Native.dense_prepare(%{})
      |> Native.unwrap!()

    [
      %{kernel: prepared, x: tensor({m, k}), residual: maybe(tensor({m, n}))},
      %{activation: activation()}
    ]
  end

  defp valid(:flash_attention) do
    {b, sq, sk, kvh, d} = {dim(2), dim(7), dim(7), dim(2), Enum.random([8, 16, 40])}
    h = kvh * dim(2)
    t = type()
    window = Enum.random([{-1, -1}, {dim(4), 0}, {dim(3), dim(3)}])

    [
      inputs(%{
        q: tensor({b, sq, h, d}, t),
        k: tensor({b, sk, kvh, d}, t),
        v: tensor({b, sk, kvh, d}, t)
      }),
      options(%{
        layout: :bshd,
        scale: Enum.random([nil, 0.3]),
        causal: Enum.random([true, false]),
        window: window,
        return_lse: Enum.random([true, false])
      })
    ]
  end

  defp valid(:rnn) do
    {cell, b, t, inp} = {Enum.random([:lstm, :gru]), dim(3), dim(7), dim(5)}

    [
      %{x: tensor({b, t, inp}), params: rnn_layers(cell, b, inp, true)},
      options(%{cell: cell, reverse: Enum.random([true, false]), precision: :f32})
    ]
  end

  defp valid(:rnn_prepare) do
    cell = Enum.random([:lstm, :gru])
    [%{params: rnn_layers(cell, dim(3), dim(5), false)}, %{cell: cell}]
  end

  defp valid(:rnn_prepared) do
    {cell, b, t, inp} = {Enum.random([:lstm, :gru]), dim(3), dim(7), dim(5)}
    layers = rnn_layers(cell, b, inp, true)
    states = Enum.map(layers, & &1.initial_state)
    no_state = Enum.map(layers, &%{&1 | initial_state: []})

    prepared = %{params: no_state} |> Native.rnn_prepare(%{cell: cell}) |> Native.unwrap!()

    states = if Enum.all?(states, &(&1 == [])), do: Enum.random([[], states]), else: states

    [
      %{params: prepared, x: tensor({b, t, inp}), initial_state: states},
      %{reverse: Enum.random([true, false])}
    ]
  end

  defp valid(:selective_scan) do
    {b, l, d, n} = {dim(2), dim(7), dim(6), dim(4)}
    t = if cuda?(), do: {:f, 32}, else: Enum.random([{:f, 32}, {:f, 64}])

    [
      inputs(%{
        u: tensor({b, l, d}, t),
        delta: tensor({b, l, d}, t),
        a: tensor({d, n}),
        b: tensor({b, l, n}, t),
        c: tensor({b, l, n}, t),
        d: maybe(tensor({d})),
        z: maybe(tensor({b, l, d}, t)),
        delta_bias: maybe(tensor({d})),
        initial_state: maybe(tensor({b, d, n}))
      }),
      options(%{
        delta_softplus: Enum.random([true, false]),
        b_discretization: Enum.random([:per_channel, :mean_dt]),
        return_last_state: Enum.random([true, false])
      })
    ]
  end

  defp valid(:norm) do
    kind = Enum.random([:layer_norm, :rms_norm])
    shape = {dim(3), dim(9)}
    cols = elem(shape, 1)
    t = type()
    beta = if kind == :layer_norm, do: maybe(tensor({cols})), else: nil

    [
      inputs(%{
        x: tensor(shape, t),
        weight: tensor({cols}),
        beta: beta,
        residual: maybe(tensor(shape, t))
      }),
      options(%{kind: kind, eps: 1.0e-5})
    ]
  end

  defp valid(:mamba_block) do
    {x, weights, _, _} = mamba()
    [inputs(%{x: x, weights: weights}), mamba_options()]
  end

  defp valid(:mamba_block_state) do
    {x, weights, conv, ssm} = mamba()
    [inputs(%{x: x, weights: weights, conv_state: conv, ssm_state: ssm}), mamba_options()]
  end

  defp valid(:stream_shift_append) do
    {b, w, c} = {dim(3), dim(5), dim(6)}
    [inputs(%{cache: tensor({b, w, c}), row: tensor({b, c})}), options(%{})]
  end

  defp valid(:stream_reshape) do
    {a, b} = {dim(), dim()}
    [inputs(%{x: tensor({a, b})}), options(%{shape: Enum.random([{b, a}, {a * b}, {1, a, b}])})]
  end

  defp valid(:engine_load) do
    {spec, params} = backbone()

    [
      %{params: flat(params)},
      %{spec: Map.from_struct(spec), backend: backend(), device: nil}
    ]
  end

  defp valid(:engine_predict) do
    {spec, engine} = engine()
    [%{engine: engine, window: tensor({dim(3), dim(5), spec.embed})}, %{}]
  end

  defp valid(:engine_init_state), do: [%{engine: elem(engine(), 1)}, %{batch: dim(3)}]

  defp valid(:engine_step) do
    {spec, engine} = engine()
    b = dim(3)
    [%{engine: engine, state: state(engine, b), frame: tensor({b, spec.embed})}, %{}]
  end

  defp valid(:engine_reset) do
    {_spec, engine} = engine()
    [%{engine: engine, state: state(engine, dim(3))}, %{}]
  end

  defp valid(:engine_state_info), do: [%{state: state(elem(engine(), 1), dim(3))}, %{}]
  defp valid(:engine_graphs), do: [%{engine: elem(engine(), 1)}, %{}]
  defp valid(:info), do: [nil]
  defp valid(:buffer_upload), do: [tensor({dim(), dim()}), nil]
  defp valid(nif) when nif in [:buffer_download, :buffer_meta], do: [make_ref()]
  defp valid(nif) when nif in [:cuda_mem_info, :cuda_synchronize], do: [nil]

  # A small recurrent backbone (LSTM or GRU, 1-2 layers) and its params; the draws of
  # random_params/2 (which seeds :rand itself) do not disturb this call's own stream.
  defp backbone do
    kind = Enum.random([:lstm, :gru])
    # embed or hidden 1 is refused by the engine today ("must have shape {3}, got {1, 3}"),
    # so the valid calls use 2 and up.
    overrides = [embed: 1 + dim(5), hidden: 1 + dim(5), layers: dim(2), window: dim(5)]
    spec = FusedKernels.Backbone.Spec.new(kind, overrides)
    saved = :rand.export_seed()
    params = FusedKernels.Backbone.random_params(spec, :rand.uniform(1000))
    :rand.seed(saved)
    {spec, params}
  end

  # An engine on the fuzz's backend; a :cuda engine the GPU refuses (or no GPU) falls back to
  # :cpu, so the engine NIFs still get a live resource (engine_load's own valid calls are
  # checked, and counted as refused, on :cuda).
  defp engine do
    {spec, params} = backbone()

    engine =
      try do
        FusedKernels.Backbone.Engine.load(spec, params, backend(), nil)
      rescue
        _ in [ArgumentError, FusedKernels.Error] ->
          FusedKernels.Backbone.Engine.load(spec, params, :cpu, nil)
      end

    {spec, engine}
  end

  defp state(engine, batch) do
    %{engine: engine} |> Native.engine_init_state(%{batch: batch}) |> Native.unwrap!()
  end

  defp activation, do: Enum.random([:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh])

  # `count` LSTM/GRU layers as the rnn NIFs take them (`input` features into the first),
  # each with a random initial state half of the time when `state?`.
  defp rnn_layers(cell, b, input, state?) do
    gates = if cell == :lstm, do: 4, else: 3

    Enum.map_reduce(1..dim(2), input, fn _, input ->
      u = dim(6)

      state =
        case {cell, state? and :rand.uniform(2) == 1} do
          {_, false} -> []
          {:lstm, true} -> [tensor({b, u}), tensor({b, u})]
          {:gru, true} -> [tensor({b, u})]
        end

      layer = %{
        input_kernel: for(_ <- 1..gates, do: tensor({input, u})),
        hidden_kernel: for(_ <- 1..gates, do: tensor({u, u})),
        bias: for(_ <- 1..4, do: tensor({u})),
        initial_state: state
      }

      {layer, u}
    end)
    |> elem(0)
  end

  defp flat(%{} = m, prefix \\ "") when not is_struct(m) do
    Enum.flat_map(m, fn {k, v} ->
      name = if prefix == "", do: to_string(k), else: prefix <> "/" <> to_string(k)
      if is_map(v), do: flat(v, name), else: [{name, v}]
    end)
  end

  defp mamba do
    {b, l, h, i, n, r, k} = {dim(2), dim(5), dim(6), dim(6), dim(4), dim(3), Enum.random(2..4)}

    weights = %{
      norm_gamma: tensor({h}),
      norm_beta: tensor({h}),
      in_kernel: tensor({h, 2 * i}),
      in_bias: maybe(tensor({2 * i})),
      conv_kernel: tensor({k, 1, i}),
      conv_bias: maybe(tensor({i})),
      bc_kernel: tensor({i, 2 * n}),
      bc_bias: maybe(tensor({2 * n})),
      dt_rank_kernel: tensor({i, r}),
      dt_rank_bias: maybe(tensor({r})),
      dt_proj_kernel: tensor({r, i}),
      dt_proj_bias: maybe(tensor({i})),
      a: maybe(tensor({i, n})),
      d: maybe(tensor({i})),
      out_kernel: tensor({i, h}),
      out_bias: maybe(tensor({h}))
    }

    {tensor({b, l, h}), weights, tensor({b, k - 1, i}), tensor({b, i, n})}
  end

  defp mamba_options do
    options(%{
      eps: 1.0e-5,
      dt_min: 0.001,
      dt_max: 0.1,
      b_discretization: Enum.random([:per_channel, :mean_dt]),
      residual: Enum.random([true, false])
    })
  end

  # ------------------------------------------------------------------ junk

  defp junk do
    Enum.random([
      fn -> [2 | 2] end,
      fn -> [tensor({2, 2}) | :tail] end,
      fn -> [1, 2 | 3] end,
      fn -> 1 <<< Enum.random([64, 70, 200]) end,
      fn -> -(1 <<< 65) end,
      fn -> -1 end,
      fn -> 0 end,
      fn -> 1.0e308 end,
      fn -> :junk end,
      fn -> nil end,
      fn -> true end,
      fn -> "string" end,
      fn -> <<1, 2, 3>> end,
      fn -> %{a: 1} end,
      fn -> make_ref() end,
      fn -> self() end,
      fn -> {} end,
      fn -> {1, 2, 3, 4, 5, 6, 7, 8, 9} end,
      fn -> [] end,
      fn -> {<<0::32>>, {1}, {:s, 32}} end,
      fn -> {<<0::32>>, {1 <<< 62, 1 <<< 62}, {:f, 32}} end,
      fn -> {<<0::32>>, {7, 7_905_747_460_161_236_407, 3}, {:f, 32}} end,
      fn -> {<<0::32>>, [2 | 2], {:f, 32}} end,
      fn -> {<<0::32>>, {}, {:f, 32}} end,
      fn -> {<<0::32>>, {1, 1, 1, 1, 1, 1, 1, 1, 1}, {:f, 32}} end,
      fn -> {<<0::32>>, {-1}, {:f, 32}} end,
      fn -> {<<0::32>>, {1}, {:f, 1 <<< 70}} end,
      fn -> {:not_binary, {1}, {:f, 32}} end,
      fn -> tensor({3}, {:f, 32}) end,
      fn -> tensor({2, 3, 4, 5, 6}, {:f, 16}) end,
      fn -> {1 <<< 62, 1 <<< 62} end,
      fn -> {-1, 1 <<< 70} end,
      fn -> Enum.random([:cuda, :nx, :auto, :gpu]) end,
      fn -> :device end,
      fn -> [[2 | 2]] end,
      fn -> [{[2 | 2], [], [], []}] end,
      fn -> [%{input_kernel: [2 | 2], hidden_kernel: [], bias: [], initial_state: []}] end,
      fn -> List.duplicate(nil, 16) end,
      fn -> List.duplicate(tensor({1}), 17) end,
      # Resources of the wrong kind, and of another engine (stale for this one).
      fn -> elem(engine(), 1) end,
      fn -> state(elem(engine(), 1), 1) end,
      fn ->
        %{kernel: tensor({2, 2})} |> Native.dense_prepare(%{}) |> Native.unwrap!()
      end,
      fn ->
        %{params: rnn_layers(:gru, 1, 2, false)}
        |> Native.rnn_prepare(%{cell: :gru})
        |> Native.unwrap!()
      end,
      fn -> [{"rnn_1/bias/bi", tensor({2})} | :tail] end,
      fn -> [{:not_a_name, tensor({2})}] end,
      fn -> %{kind: :lstm} end
    ]).()
  end
end
