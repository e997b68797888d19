defmodule FusedKernels.BackboneFairnessTest do
  # The CPU engine's long windows run on the library's job lanes (the long lane), not on the
  # BEAM's dirty schedulers, so a short engine step answers while several long windows
  # compute (native/fused_kernels_nif/src/engine.rs). Before, every engine call held a dirty
  # CPU scheduler for as long as it computed: four long windows held both of a 2-core
  # machine and a frame waited behind them.
  use ExUnit.Case
  @moduletag timeout: 300_000

  alias FusedKernels.{Backbone, Sample}
  alias FusedKernels.Backbone.Spec

  @long_calls 4
  @short_calls 15
  @bound_ms 50

  test "an engine step answers within #{@bound_ms} ms while #{@long_calls} long engine windows run" do
    # 2 GRU layers of 256 over 64 rows x 240 steps: hundreds of ms per window on one core.
    long = Spec.new(:gru, window: 240)
    lh = Backbone.load(long, Backbone.random_params(long, 1), backend: :cpu)
    win = Sample.random_triple({64, 240, long.embed}, {:f, 32})

    short = Spec.new(:gru, layers: 1, hidden: 32, embed: 24, window: 16)
    sh = Backbone.load(short, Backbone.random_params(short, 2), backend: :cpu)
    state = Backbone.init_state(sh, 1)
    frame = Sample.random_triple({1, short.embed}, {:f, 32})
    # The first steps size the state's workspace and measure the step.
    for _ <- 1..3, do: Backbone.step(sh, state, frame)

    longs = for _ <- 1..@long_calls, do: Task.async(fn -> Backbone.predict(lh, win) end)
    Process.sleep(200)

    times =
      for _ <- 1..@short_calls do
        {us, {out, _}} = :timer.tc(fn -> Backbone.step(sh, state, frame) end)
        assert {_, {1, 32}, {:f, 32}} = out
        div(us, 1000)
      end

    polled = Enum.map(longs, &Task.yield(&1, 0))
    running = Enum.count(polled, &is_nil/1)

    results =
      Enum.zip_with(longs, polled, fn
        task, nil -> Task.await(task, 300_000)
        _task, {:ok, result} -> result
      end)

    assert Enum.all?(results, &match?({_, {64, 256}, {:f, 32}}, &1))

    median = times |> Enum.sort() |> Enum.at(div(@short_calls, 2))

    assert median <= @bound_ms,
           "engine step took #{inspect(times)} ms (median #{median}) during long windows"

    # The measurement means something only if the long windows were still running.
    assert running >= 2,
           "only #{running} long windows were still running after the short steps; make them longer"
  end
end
