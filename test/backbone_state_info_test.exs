defmodule FusedKernels.BackboneStateInfoTest do
  # `engine_state_info` on a state that another process is stepping: the NIF takes the
  # state's lock only when it is free and otherwise continues on a dirty scheduler
  # (native/fused_kernels_nif/src/engine.rs), so every answer is right, whichever way it took.
  use ExUnit.Case, async: false

  alias FusedKernels.{Backbone, Native, Sample}
  alias FusedKernels.Backbone.Spec

  test "state_info answers while another process steps the same state" do
    # Frames long enough (batch 64, hidden 256) that the stepping process holds the state's
    # lock for a good part of the time.
    spec = Spec.new(:lstm, embed: 64, hidden: 256, layers: 2)
    h = Backbone.load(spec, Backbone.random_params(spec, 3), backend: :cpu)
    batch = 64
    state = Backbone.init_state(h, batch)
    frame = Sample.random_triple({batch, spec.embed}, {:f, 32})
    n = 60

    stepper =
      Task.async(fn ->
        for _ <- 1..n, do: Backbone.step(h, state, frame)
        :done
      end)

    seen =
      Stream.repeatedly(fn -> Native.engine_state_info(%{state: state.ref}, %{}) end)
      |> Enum.reduce_while([], fn reply, acc ->
        assert {:ok, {^batch, frames}} = reply
        assert frames in 0..n
        if frames == n, do: {:halt, [frames | acc]}, else: {:cont, [frames | acc]}
      end)
      |> Enum.reverse()

    assert Task.await(stepper, 120_000) == :done
    # The count only moves on.
    assert seen == Enum.sort(seen)
    assert List.last(seen) == n
  end
end
