# Several BEAM processes, each with its own backbone handle (its own engine), calling at once:
# per-call median/p99 and aggregate calls/s for 1, 2, 4 and 8 processes. Host window/frame in,
# host output back, as in `mix bench`.
#
# Every process calls back to back from a common start until a common deadline (`--ms`, after
# 30 warm-up calls each); the aggregate is all calls completed over that time, so all N
# processes run for the whole of it. (A fixed count of calls per process, as before, ended each
# run with its slowest processes alone, and that tail counted in the aggregate.) Each row also
# prints the fewest and most calls one process made: how evenly the device was shared. Each
# count runs `--rounds` times (5 on the GPU), the counts' order rotating each round; a row's
# aggregate is the median over its rounds (each round's printed beside it), its median and p99
# per call over all of its rounds' calls.
#
# Usage: mix run bench/backbone_concurrency.exs [cuda|cpu] [JSON_PATH] [--only gru|gru1]
#   [--modes window,frame] [--ms MS] [--rounds R]
alias FusedKernels.{Backbone, Sample}
alias FusedKernels.Backbone.Spec

defmodule Concurrency do
  @moduledoc false

  @doc """
  One timed run: `n` processes, each loading its own engine, calling from a common start until
  `run_ms` later. All calls completed over the elapsed time, each call's µs, each process' count.
  """
  def measure(backend, spec, params, shape, mode, n, run_ms) do
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
          deadline = receive do: ({:go, d} -> d)
          send(parent, {:done, self(), run_until(call, deadline, [])})
        end)
      end

    for p <- pids, do: receive(do: ({:ready, ^p} -> :ok))
    t0 = System.monotonic_time(:nanosecond)
    for p <- pids, do: send(p, {:go, t0 + run_ms * 1_000_000})
    per = Enum.map(pids, fn p -> receive(do: ({:done, ^p, ts} -> ts)) end)
    wall = (System.monotonic_time(:nanosecond) - t0) / 1.0e9
    counts = Enum.map(per, &length/1)
    %{calls_per_s: Enum.sum(counts) / wall, times: Enum.concat(per), counts: counts}
  end

  @doc "Calls `call` back to back until the monotonic clock passes `deadline` (ns): the µs of each."
  def run_until(call, deadline, acc) do
    t = System.monotonic_time(:nanosecond)

    if t >= deadline do
      acc
    else
      call.()
      run_until(call, deadline, [(System.monotonic_time(:nanosecond) - t) / 1000 | acc])
    end
  end
end

{opts, args, _} =
  OptionParser.parse(System.argv(),
    strict: [only: :string, modes: :string, ms: :integer, rounds: :integer]
  )

[backend | rest] = args ++ ["cuda"]
backend = String.to_existing_atom(backend)
json = List.first(rest -- ["cuda"])
# The timed run: on the H100 ~16,000-20,000 frames or ~1,800-4,500 windows of one process.
run_ms = Keyword.get(opts, :ms, if(backend == :cuda, do: 300, else: 2000))
rounds = Keyword.get(opts, :rounds, if(backend == :cuda, do: 5, else: 1))

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

counts = [1, 2, 4, 8]

rows =
  for {key, label, spec} <- [
        {"gru", "gru", Spec.new(:gru)},
        {"gru1", "gru1 w16", Spec.new(:gru, layers: 1, window: 16)}
      ],
      only in [nil, key],
      mode <- modes do
    params = Backbone.random_params(spec, 1)
    shape = if mode == :window, do: {1, spec.window, spec.embed}, else: {1, spec.embed}

    # Rounds of every process count, the order rotating each round, so that a slow phase of
    # the machine does not fall on one count alone.
    runs =
      for r <- 0..(rounds - 1),
          n <- Enum.drop(counts, rem(r, 4)) ++ Enum.take(counts, rem(r, 4)) do
        {n, Concurrency.measure(backend, spec, params, shape, mode, n, run_ms)}
      end

    for n <- counts do
      mine = for {^n, m} <- runs, do: m
      rates = mine |> Enum.map(& &1.calls_per_s) |> Enum.sort()
      sorted = mine |> Enum.flat_map(& &1.times) |> Enum.sort()
      calls = Enum.flat_map(mine, & &1.counts)

      row = %{
        case: "backbone #{label} #{mode}",
        backend: backend,
        processes: n,
        median_us: percentile.(sorted, 0.5),
        p99_us: percentile.(sorted, 0.99),
        calls_per_s: percentile.(rates, 0.5),
        rates: rates,
        fewest: Enum.min(calls),
        most: Enum.max(calls)
      }

      spread =
        if rounds > 1,
          do: " (rounds #{Enum.map_join(rates, " ", &round/1)})",
          else: ""

      IO.puts(
        "#{String.pad_trailing(row.case, 26)} #{n} procs  median #{Float.round(row.median_us, 1)} us" <>
          "  p99 #{Float.round(row.p99_us, 1)} us  #{round(row.calls_per_s)} calls/s#{spread}" <>
          "  calls per process #{row.fewest}-#{row.most}"
      )

      row
    end
  end
  |> Enum.concat()

if json do
  body =
    Enum.map_join(rows, ",\n", fn r ->
      ~s({"case": "#{r.case}", "backend": "#{r.backend}", "processes": #{r.processes}, ) <>
        ~s("median_us": #{r.median_us}, "p99_us": #{r.p99_us}, "calls_per_s": #{r.calls_per_s}, ) <>
        ~s("rounds_calls_per_s": [#{Enum.join(r.rates, ", ")}], ) <>
        ~s("fewest_calls": #{r.fewest}, "most_calls": #{r.most}})
    end)

  File.write!(json, "[\n" <> body <> "\n]\n")
end
