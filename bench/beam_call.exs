# What one NIF call costs the BEAM before any work is done, by where it runs, next to the CPU
# engine's step: round trip from Elixir, median and p99 µs of `--runs` calls after warm-up.
#
#   normal        engine_state_info on a normal scheduler (decodes a resource, takes a mutex)
#   dirty_cpu     engine_graphs of a CPU engine (returns []) on a dirty CPU scheduler
#   job_lane      scaled_softmax of one value through the CPU job lanes (queue, worker, message)
#   engine_step   Native.engine_step of a CPU engine (1-layer GRU, hidden 256, batch 1) and
#                 its reply: the engine's NIF round trip, kernels included
#   backbone_step Backbone.step/3 of the same engine (the public call)
#
# With --backbones, instead: Backbone.step/3 and Backbone.predict/2 of every backbone on :cuda
# at ExPhil's sizes (and the 1-layer window-16 GRU), batch 1, the GPU engine's whole call from
# Elixir (`mix bench`'s backbone rows, batch 1 only; a quick A/B of two NIF builds through
# FUSED_KERNELS_NIF_PATH).
#
# With --load N, while N processes call the GPU back to back (each its own engine; in turn ExPhil's
# GRU windows, its 1-layer window-16 GRU's windows and ExPhil's GRU frames), the first rows (and a
# message round trip between two processes, `pingpong`) are timed: what the GPU calls' starts on
# the normal schedulers cost everybody else (run with `ELIXIR_ERL_OPTIONS="+S 2:2"` for a small
# machine's schedulers).
#
# Usage: mix run bench/beam_call.exs [--runs N] [--json PATH] [--backbones] [--load N]
alias FusedKernels.{Backbone, Native, Sample}
alias FusedKernels.Backbone.Spec

{opts, _, _} =
  OptionParser.parse(System.argv(),
    strict: [runs: :integer, json: :string, backbones: :boolean, load: :integer]
  )

runs = Keyword.get(opts, :runs, 3000)

cases =
  if opts[:backbones] do
    specs =
      for(kind <- Backbone.supported(), do: {to_string(kind), Spec.new(kind)}) ++
        [{"gru1 w16", Spec.new(:gru, layers: 1, window: 16)}]

    for {label, spec} <- specs, mode <- [:frame, :window] do
      h = Backbone.load(spec, Backbone.random_params(spec, 1), backend: :cuda)

      f =
        case mode do
          :frame ->
            state = Backbone.init_state(h, 1)
            x = Sample.random_triple({1, spec.embed}, {:f, 32})
            fn -> Backbone.step(h, state, x) end

          :window ->
            x = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
            fn -> Backbone.predict(h, x) end
        end

      {"#{label} #{mode}", f}
    end
  else
    spec = Spec.new(:gru, layers: 1, window: 16)
    h = Backbone.load(spec, Backbone.random_params(spec, 1), backend: :cpu)
    state = Backbone.init_state(h, 1)
    frame = Sample.random_triple({1, spec.embed}, {:f, 32})
    one = Sample.random_triple({1, 1}, {:f, 32})

    [
      {"normal", fn -> Native.engine_state_info(%{state: state.ref}, %{}) end},
      {"dirty_cpu", fn -> Native.engine_graphs(%{engine: h.engine}, %{}) end},
      {"job_lane",
       fn ->
         Native.scaled_softmax(%{x: one}, %{scale: 1.0, causal: false, backend: :cpu, out: :host})
       end},
      {"engine_step",
       fn ->
         case Native.engine_step(%{engine: h.engine, state: state.ref, frame: frame}, %{}) do
           ref when is_reference(ref) ->
             receive do
               {^ref, reply} -> reply
             end

           reply ->
             reply
         end
       end},
      {"backbone_step", fn -> Backbone.step(h, state, frame) end}
    ]
  end

load = Keyword.get(opts, :load, 0)

loaders =
  if load > 0 do
    parent = self()

    # In turn: ExPhil's GRU windows, its 1-layer window-16 GRU's windows, ExPhil's GRU frames.
    pids =
      for i <- 1..load do
        spawn_link(fn ->
          spec =
            if rem(i, 3) == 2, do: Spec.new(:gru, layers: 1, window: 16), else: Spec.new(:gru)

          h = Backbone.load(spec, Backbone.random_params(spec, 1), backend: :cuda)

          call =
            if rem(i, 3) == 0 do
              state = Backbone.init_state(h, 1)
              x = Sample.random_triple({1, spec.embed}, {:f, 32})
              fn -> Backbone.step(h, state, x) end
            else
              x = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
              fn -> Backbone.predict(h, x) end
            end

          for _ <- 1..20, do: call.()
          send(parent, {:loaded, self()})
          Stream.repeatedly(call) |> Stream.run()
        end)
      end

    for p <- pids, do: receive(do: ({:loaded, ^p} -> :ok))
    pids
  else
    []
  end

cases =
  if load > 0 do
    echo =
      spawn_link(fn ->
        Stream.repeatedly(fn -> receive(do: ({from, m} -> send(from, m))) end) |> Stream.run()
      end)

    me = self()
    [{"pingpong", fn -> send(echo, {me, :ping}) && receive(do: (:ping -> :ok)) end} | cases]
  else
    cases
  end

time = fn f ->
  for _ <- 1..div(runs, 10), do: f.()

  for _ <- 1..runs do
    t0 = System.monotonic_time(:nanosecond)
    f.()
    System.monotonic_time(:nanosecond) - t0
  end
  |> Enum.sort()
end

pct = fn sorted, p -> Enum.at(sorted, min(length(sorted) - 1, trunc(p * length(sorted)))) end

rows =
  for {name, f} <- cases do
    # Every case must succeed: a refused call would time an error path.
    case f.() do
      {:error, e} -> raise "#{name}: #{inspect(e)}"
      _ -> :ok
    end

    s = time.(f)
    med = pct.(s, 0.5) / 1000
    p99 = pct.(s, 0.99) / 1000
    p999 = pct.(s, 0.999) / 1000
    max = List.last(s) / 1000
    over = Enum.count(s, &(&1 > 2000 * med))

    IO.puts(
      :io_lib.format(
        "~-14s median ~8.2f us   p99 ~8.2f us   p99.9 ~8.2f us   max ~8.2f us   >2x median ~B",
        [name, med, p99, p999, max, over]
      )
    )

    %{name: name, median_us: med, p99_us: p99, p999_us: p999, max_us: max, runs: runs}
  end

for p <- loaders, do: Process.unlink(p) && Process.exit(p, :kill)

if path = opts[:json] do
  File.write!(
    path,
    "[" <>
      Enum.map_join(rows, ",", fn r ->
        ~s({"name":"#{r.name}","load":#{load},"median_us":#{r.median_us},"p99_us":#{r.p99_us},) <>
          ~s("p999_us":#{r.p999_us},"max_us":#{r.max_us},"runs":#{r.runs}})
      end) <> "]"
  )
end
