# The Elixir half of bench/cpu/side.py: times our CPU rows through the public native API (the
# same calls an application makes, NIF and BEAM included) on the inputs side.py wrote.
#
#   FUSED_KERNELS_CPU_THREADS=1 mix run bench/cpu/side.exs DIR
#
# A line-oriented server on stdin/stdout, so side.py can interleave our runs with ONNX Runtime
# and PyTorch: `time ROW N` answers `ms T1 T2 ...` (N per-call wall times), `check ROW`
# writes DIR/ROW/ours.f32 (the output of one call from the written inputs) and answers `ok`.
# DIR/ROW/manifest.txt lists `name d1,d2,...` for each NAME.f32 (little-endian f32).
#
# Backbone rows (`backbone_KIND_window`, `backbone_KIND_frame`): `backbones KIND,...` builds
# each backbone's CPU engine from `Backbone.random_params/2` and writes, for the PyTorch side,
# DIR/backbone/KIND_params.{json,bin} (`Backbone.export_params/2`), KIND_window.bin (one
# window), KIND_out.bin (our predict on it) and KIND_frame_out.bin (our step from a fresh
# state on the window's last frame); then answers `ok`. The frame row times `step` with the
# state carried, after a window's worth of frames (the attention cache full).

defmodule Side do
  def load(dir, row) do
    path = Path.join(dir, row)

    path
    |> Path.join("manifest.txt")
    |> File.read!()
    |> String.split("\n", trim: true)
    |> Map.new(fn line ->
      [name, dims] = String.split(line, " ")
      shape = dims |> String.split(",", trim: true) |> Enum.map(&String.to_integer/1)
      bin = File.read!(Path.join(path, name <> ".f32"))
      {name, {bin, List.to_tuple(shape), {:f, 32}}}
    end)
  end

  defp rnn_params(t, cell, layers) do
    {ins, hids, biases} = FusedKernels.Rnn.gate_names(cell)

    for l <- 0..(layers - 1) do
      pick = fn names -> Map.new(names, &{&1, t["l#{l}_#{&1}"]}) end
      %{"input_kernel" => pick.(ins), "hidden_kernel" => pick.(hids), "bias" => pick.(biases)}
    end
  end

  defp init_state(t, :lstm, layers),
    do: for(l <- 0..(layers - 1), do: {t["l#{l}_c0"], t["l#{l}_h0"]})

  defp init_state(t, :gru, layers), do: for(l <- 0..(layers - 1), do: {t["l#{l}_h0"]})

  defp cell_of("lstm" <> _), do: :lstm
  defp cell_of("gru" <> _), do: :gru

  @doc "A closure running one call of `row`; with a carried state for the step rows."
  def runner(row, t) do
    case row do
      "lstm_window" <> _ ->
        rnn_window(row, t)

      "gru_window" <> _ ->
        rnn_window(row, t)

      "lstm_step" <> _ ->
        rnn_step(row, t)

      "gru_step" <> _ ->
        rnn_step(row, t)

      "attention" <> _ ->
        fn _ ->
          FusedKernels.FlashAttention.native(t["q"], t["k"], t["v"], causal: true, backend: :cpu)
        end

      "dense" <> _ ->
        # Prepared once, as for the RNN rows.
        kernel = FusedKernels.Dense.prepare(t["kernel"], t["bias"], backend: :cpu)
        fn _ -> FusedKernels.Dense.dense(t["x"], kernel, activation: :gelu, backend: :cpu) end

      "scan" <> _ ->
        fn _ ->
          FusedKernels.SelectiveScan.native(t["u"], t["delta"], t["a"], t["b"], t["c"],
            d: t["d"],
            delta_softplus: true,
            backend: :cpu
          )
        end
    end
  end

  # The weights are prepared once (FusedKernels.Rnn.prepare/3), as ONNX Runtime's session
  # prepares them when it loads.
  defp rnn_window(row, t) do
    cell = cell_of(row)
    params = FusedKernels.Rnn.prepare(cell, rnn_params(t, cell, 2), backend: :cpu)
    fn _ -> elem(FusedKernels.Rnn.native(cell, t["x"], params, backend: :cpu), 0) end
  end

  defp rnn_step(row, t) do
    cell = cell_of(row)
    params = FusedKernels.Rnn.prepare(cell, rnn_params(t, cell, 2), backend: :cpu)
    # The state is carried from call to call, as a streaming caller does.
    fn state ->
      state = state || init_state(t, cell, 2)

      {seq, states} =
        FusedKernels.Rnn.native(cell, t["x"], params, initial_state: state, backend: :cpu)

      {seq, states}
    end
  end

  def time(run, n) do
    {_, times} =
      Enum.reduce(1..n, {nil, []}, fn _, {state, acc} ->
        t0 = System.monotonic_time(:nanosecond)
        out = run.(state)
        dt = System.monotonic_time(:nanosecond) - t0
        next = if match?({_, [_ | _]}, out), do: elem(out, 1), else: nil
        {next, [dt / 1.0e6 | acc]}
      end)

    Enum.reverse(times)
  end

  def output_binary(out) do
    case out do
      {{bin, _, _}, _states} when is_binary(bin) -> bin
      {bin, _, _} when is_binary(bin) -> bin
    end
  end

  def loop(dir, cache) do
    case IO.gets("") do
      :eof ->
        :ok

      line ->
        {reply, cache} =
          case String.split(String.trim(line), " ") do
            ["time", row, n] ->
              {run, cache} = fetch(dir, row, cache)
              ms = time(run, String.to_integer(n))
              {"ms " <> Enum.map_join(ms, " ", &Float.to_string/1), cache}

            ["backbones", kinds] ->
              {"ok", Map.merge(cache, Backbones.export(dir, String.split(kinds, ",")))}

            ["check", row] ->
              {run, cache} = fetch(dir, row, cache)
              File.write!(Path.join([dir, row, "ours.f32"]), output_binary(run.(nil)))
              {"ok", cache}

            other ->
              {"error unknown command #{inspect(other)}", cache}
          end

        IO.puts(reply)
        loop(dir, cache)
    end
  end

  defp fetch(dir, row, cache) do
    case cache do
      %{^row => run} ->
        {run, cache}

      _ ->
        run = runner(row, load(dir, row))
        {run, Map.put(cache, row, run)}
    end
  end
end

defmodule Backbones do
  alias FusedKernels.{Backbone, Sample}
  alias FusedKernels.Backbone.Spec

  @doc "Exports each backbone (see the header) and returns its two timing runners by row."
  def export(dir, kinds) do
    out = Path.join(dir, "backbone")
    File.mkdir_p!(out)
    # Spec names the kinds: loaded first, so that their atoms exist for to_existing_atom.
    Code.ensure_loaded!(Spec)

    for kind <- kinds, reduce: %{} do
      acc ->
        kind = String.to_existing_atom(kind)
        spec = Spec.new(kind)
        params = Backbone.random_params(spec, 1)
        Backbone.export_params(params, Path.join(out, "#{kind}_params"))
        {bin, _, _} = win = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
        frame_bytes = spec.embed * 4

        frame =
          {binary_part(bin, byte_size(bin) - frame_bytes, frame_bytes), {1, spec.embed}, {:f, 32}}

        h = Backbone.load(spec, params, backend: :cpu)
        {y, _, _} = Backbone.predict(h, win)
        {{fy, _, _}, _} = Backbone.step(h, Backbone.init_state(h, 1), frame)
        File.write!(Path.join(out, "#{kind}_window.bin"), bin)
        File.write!(Path.join(out, "#{kind}_out.bin"), y)
        File.write!(Path.join(out, "#{kind}_frame_out.bin"), fy)
        # The engine's state is a resource advanced in place by each step.
        state = Backbone.init_state(h, 1)
        for _ <- 1..spec.window, do: Backbone.step(h, state, frame)

        Map.merge(acc, %{
          "backbone_#{kind}_window" => fn _ -> Backbone.predict(h, win) end,
          "backbone_#{kind}_frame" => fn _ -> elem(Backbone.step(h, state, frame), 0) end
        })
    end
  end
end

[dir] = System.argv()
IO.puts("ready threads=#{FusedKernels.info()[:cpu_threads]}")
Side.loop(dir, %{})
