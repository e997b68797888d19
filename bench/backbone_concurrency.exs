# Several BEAM processes, each with its own backbone handle (its own engine), calling at once:
# per-call median/p99 and aggregate calls/s for 1, 2, 4 and 8 processes. Host window/frame in,
# host output back, as in `mix bench`.
#
# Usage: mix run bench/backbone_concurrency.exs [cuda|cpu] [JSON_PATH] [--only gru|gru1]
#   [--modes window,frame]
alias FusedKernels.{Backbone, Sample}
alias FusedKernels.Backbone.Spec

{opts, args, _} = OptionParser.parse(System.argv(), strict: [only: :string, modes: :string])
[backend | rest] = args ++ ["cuda"]
backend = String.to_existing_atom(backend)
json = List.first(rest -- ["cuda"])
# Calls per process: on the GPU a frame row of 300 calls spans ~5 ms, where one late start or
# one pause of a process moved the aggregate by 2x between runs; 3,000 frames (600 windows) span
# ~50-100 ms.
calls_of = fn
  :window when backend == :cuda -> 600
  :frame when backend == :cuda -> 3000
  _ -> 20
end

modes =
  opts
  |> Keyword.get(:modes, "window,frame")
  |> String.split(",")
  |> Enum.map(fn
    "window" -> :window
    "frame" -> :frame
    m -> raise ArgumentError, "--modes: window and/or frame, got #{inspect(m)}"
  end)

only = Keyword.get(opts, :only)

percentile = fn sorted, p ->
  Enum.at(sorted, min(length(sorted) - 1, trunc(p * length(sorted))))
end

rows =
  for {key, label, spec} <- [
        {"gru", "gru", Spec.new(:gru)},
        {"gru1", "gru1 w16", Spec.new(:gru, layers: 1, window: 16)}
      ],
      only in [nil, key],
      mode <- modes,
      n <- [1, 2, 4, 8] do
    calls = calls_of.(mode)
    params = Backbone.random_params(spec, 1)
    shape = if mode == :window, do: {1, spec.window, spec.embed}, else: {1, spec.embed}
    parent = self()

    pids =
      for _ <- 1..n do
        spawn_link(fn ->
          h = Backbone.load(spec, params, backend: backend)
          x = Sample.random_triple(shape, {:f, 32})
          state = Backbone.init_state(h, 1)

          call =
            if mode == :window,
              do: fn -> Backbone.predict(h, x) end,
              else: fn -> Backbone.step(h, state, x) end

          for _ <- 1..30, do: call.()
          send(parent, {:ready, self()})
          receive do: (:go -> :ok)

          times =
            for _ <- 1..calls do
              t = System.monotonic_time(:nanosecond)
              call.()
              (System.monotonic_time(:nanosecond) - t) / 1000
            end

          send(parent, {:done, self(), times})
        end)
      end

    for p <- pids, do: receive(do: ({:ready, ^p} -> :ok))
    t0 = System.monotonic_time(:nanosecond)
    for p <- pids, do: send(p, :go)
    times = Enum.flat_map(pids, fn p -> receive(do: ({:done, ^p, ts} -> ts)) end)
    wall = (System.monotonic_time(:nanosecond) - t0) / 1.0e9
    sorted = Enum.sort(times)

    row = %{
      case: "backbone #{label} #{mode}",
      backend: backend,
      processes: n,
      median_us: percentile.(sorted, 0.5),
      p99_us: percentile.(sorted, 0.99),
      calls_per_s: n * calls / wall
    }

    IO.puts(
      "#{String.pad_trailing(row.case, 26)} #{n} procs  median #{Float.round(row.median_us, 1)} us" <>
        "  p99 #{Float.round(row.p99_us, 1)} us  #{round(row.calls_per_s)} calls/s"
    )

    row
  end

if json do
  body =
    Enum.map_join(rows, ",\n", fn r ->
      ~s({"case": "#{r.case}", "backend": "#{r.backend}", "processes": #{r.processes}, ) <>
        ~s("median_us": #{r.median_us}, "p99_us": #{r.p99_us}, "calls_per_s": #{r.calls_per_s}})
    end)

  File.write!(json, "[\n" <> body <> "\n]\n")
end
