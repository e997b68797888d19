defmodule FusedKernels.BackboneCallTest do
  # The GPU engine's call in two halves (native/fused_kernels_nif/src/engine.rs): started on the
  # normal scheduler, waited for on a dirty one. Callers killed between the halves leave the
  # engine working and every other stream right; processes sharing one engine, each with its
  # own state, get their own streams bit for bit. (The halves against the ordinary path on every
  # backbone, calls in flight and abandoned ones: native/fused_kernels_core/tests/engine_start.rs.)
  use ExUnit.Case, async: false

  alias FusedKernels.{Backbone, Sample}
  alias FusedKernels.Backbone.Spec

  @moduletag :cuda

  defp small(kind), do: Spec.new(kind, embed: 24, hidden: 32, heads: 2, head_dim: 16, window: 16)

  defp frames(spec, n, seed) do
    :rand.seed(:exsss, {seed, 7, 11})
    for _ <- 1..n, do: Sample.random_triple({1, spec.embed}, {:f, 32})
  end

  defp stream(h, frames) do
    state = Backbone.init_state(h, 1)
    for f <- frames, do: elem(Backbone.step(h, state, f), 0)
  end

  # `fun` in a task that must answer within 5 s (a wedged engine would not).
  defp within(fun) do
    task = Task.async(fun)

    case Task.yield(task, 5_000) || Task.shutdown(task, :brutal_kill) do
      {:ok, v} -> v
      nil -> flunk("the engine call did not answer within 5 s")
    end
  end

  defp spin(0), do: :ok
  defp spin(n), do: spin(n - 1)

  for kind <- [:gru, :lstm, :attention, :mamba] do
    test "#{kind}: callers killed between the halves leave the engine working" do
      spec = small(unquote(kind))
      h = Backbone.load(spec, Backbone.random_params(spec, 1), backend: :cuda)
      xs = frames(spec, 12, 1)
      want = stream(h, xs)
      win = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
      want_win = Backbone.predict(h, win)

      # Callers streaming frames (and windows) killed at random moments once their calls run
      # in halves (the shapes warm, their graphs captured): many between a call's start and
      # its finish.
      parent = self()

      for i <- 1..200 do
        pid =
          spawn(fn ->
            s = Backbone.init_state(h, 1)
            for f <- Enum.take(xs, 4), do: Backbone.step(h, s, f)
            send(parent, {:warm, self()})

            Stream.cycle(xs)
            |> Enum.each(fn f ->
              Backbone.step(h, s, f)
              if rem(i, 3) == 0, do: Backbone.predict(h, win)
            end)
          end)

        receive do
          {:warm, ^pid} -> :ok
        after
          5_000 -> flunk("a caller did not warm up")
        end

        spin(:rand.uniform(20_000))
        Process.exit(pid, :kill)
      end

      assert within(fn -> stream(h, xs) end) == want
      assert within(fn -> Backbone.predict(h, win) end) == want_win
    end
  end

  test "processes sharing one engine, each its own state, get their own streams" do
    spec = small(:gru)
    h = Backbone.load(spec, Backbone.random_params(spec, 2), backend: :cuda)
    inputs = for p <- 1..4, do: frames(spec, 80, 10 + p)
    want = Enum.map(inputs, &stream(h, &1))
    win = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
    want_win = Backbone.predict(h, win)

    got =
      inputs
      |> Enum.with_index()
      |> Enum.map(fn {xs, p} ->
        Task.async(fn ->
          s = Backbone.init_state(h, 1)

          for {f, i} <- Enum.with_index(xs) do
            # A window now and then between one process's frames (it stops the persistent
            # frame kernel; the next frame starts it again).
            if rem(i + p, 17) == 0, do: assert(Backbone.predict(h, win) == want_win)
            elem(Backbone.step(h, s, f), 0)
          end
        end)
      end)
      |> Task.await_many(30_000)

    assert got == want
  end
end
