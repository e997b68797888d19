defmodule FusedKernels.BackboneTest do
  # Full-window predict and frame-by-frame streaming must agree; every backend must agree with
  # the Axon model on the same params.
  use ExUnit.Case, async: true

  alias FusedKernels.{Backbone, TestRef}
  alias FusedKernels.Backbone.Spec

  defp window({bin, {b, _t, e}, type}, i),
    do: {binary_part(bin, i * e * 4, e * 4 * b), {b, e}, type}

  defp stream(handle, {_, {b, t, _}, _} = win) do
    Enum.reduce(0..(t - 1), {nil, Backbone.init_state(handle, b)}, fn i, {_, state} ->
      Backbone.step(handle, state, window(win, i))
    end)
    |> elem(0)
  end

  defp assert_close({a, shape, type}, {b, shape, type}, tol) do
    err = TestRef.rel_l2(TestRef.decode(a, type), TestRef.decode(b, type))
    assert err <= tol, "rel L2 #{err}"
  end

  for kind <- Spec.kinds(), backend <- [:cpu, :cuda] do
    if backend == :cuda, do: @tag(:cuda)

    test "#{kind} on #{backend}: streaming 60 frames equals predict on the window" do
      spec = Spec.new(unquote(kind))
      handle = Backbone.load(spec, Backbone.random_params(spec, 3), backend: unquote(backend))
      win = FusedKernels.Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
      full = Backbone.predict(handle, win)
      assert {_, {1, 256}, {:f, 32}} = full
      assert_close(stream(handle, win), full, 1.0e-5)
    end
  end

  test "streaming past the window keeps the KV caches and Mamba states consistent" do
    # After 60 frames the caches slide: frames 61.. must still run and stay finite.
    for kind <- [:attention, :jamba, :mamba] do
      spec = Spec.new(kind, window: 5)
      handle = Backbone.load(spec, Backbone.random_params(spec, 4), backend: :cpu)
      win = FusedKernels.Sample.random_triple({2, 9, spec.embed}, {:f, 32})
      {bin, {2, 256}, _} = stream(handle, win)
      assert Enum.all?(TestRef.decode(bin, {:f, 32}), &is_float/1)
    end
  end

  test "missing parameters are named" do
    spec = Spec.new(:gru)
    params = Map.delete(Backbone.random_params(spec), "rnn_2_norm")

    assert_raise ArgumentError, ~r/params is missing the layer "rnn_2_norm"/, fn ->
      Backbone.load(spec, params, backend: :cpu)
    end
  end

  @tag :cuda
  test "cuda and cpu backbones agree" do
    for kind <- Spec.kinds() do
      spec = Spec.new(kind)
      params = Backbone.random_params(spec, 5)
      win = FusedKernels.Sample.random_triple({3, 61, spec.embed}, {:f, 32})
      cpu = Backbone.predict(Backbone.load(spec, params, backend: :cpu), win)
      gpu = Backbone.predict(Backbone.load(spec, params, backend: :cuda), win)
      assert_close(gpu, cpu, 1.0e-5)
    end
  end
end
