defmodule FusedKernels.BackboneTest do
  # Full-window predict and frame-by-frame streaming must agree; every backend must agree with
  # the Axon model on the same params.
  use ExUnit.Case, async: true

  alias FusedKernels.{Backbone, TestRef}
  alias FusedKernels.Backbone.Spec

  defp window({bin, {b, t, e}, type}, i),
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

  for kind <- [:lstm, :gru], backend <- [:cpu, :cuda] do
    @tag if(backend == :cuda, do: :cuda, else: :native)
    test "#{kind} on #{backend}: streaming 60 frames equals predict on the window" do
      spec = Spec.new(unquote(kind))
      handle = Backbone.load(spec, Backbone.random_params(spec, 3), backend: unquote(backend))
      win = FusedKernels.Bench.random_triple({1, spec.window, spec.embed}, {:f, 32})
      full = Backbone.predict(handle, win)
      assert {_, {1, 256}, {:f, 32}} = full
      assert_close(stream(handle, win), full, 1.0e-5)
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
    for kind <- [:lstm, :gru] do
      spec = Spec.new(kind)
      params = Backbone.random_params(spec, 5)
      win = FusedKernels.Bench.random_triple({3, 61, spec.embed}, {:f, 32})
      cpu = Backbone.predict(Backbone.load(spec, params, backend: :cpu), win)
      gpu = Backbone.predict(Backbone.load(spec, params, backend: :cuda), win)
      assert_close(gpu, cpu, 1.0e-5)
    end
  end

  @tag :axon
  test "predict equals the Axon model on the same params, on every backend" do
    for kind <- [:lstm, :gru] do
      spec = Spec.new(kind, window: 13)
      params = Backbone.random_params(spec, 9) |> to_nx()

      x =
        Nx.tensor(for(_ <- 1..(2 * 13 * 288), do: :rand.uniform() * 2 - 1), type: :f32)
        |> Nx.reshape({2, 13, 288})

      {_init, predict} = Axon.build(Backbone.AxonModel.build(spec))
      expected = predict.(params, x)

      for backend <-
            [:nx, :cpu] ++ if(FusedKernels.Backend.cuda_available?(), do: [:cuda], else: []) do
        got = Backbone.predict(Backbone.load(spec, params, backend: backend), x)

        assert Nx.all_close(got, expected, atol: 1.0e-4, rtol: 1.0e-4) |> Nx.to_number() == 1,
               "#{kind} #{backend}"
      end
    end
  end

  defp to_nx(%{} = m), do: Map.new(m, fn {k, v} -> {k, to_nx(v)} end)
  defp to_nx(triple), do: FusedKernels.Tensor.to_nx(triple)
end
