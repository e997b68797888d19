defmodule FusedKernels.Bench.Backbone do
  @moduledoc false
  # Rows for `mix bench`: each supported backbone at ExPhil's configuration, the full
  # 60-frame window and one streamed frame, batch 1 and 8, plus ExPhil's production model
  # (1-layer GRU, window 16). Timed from Elixir around the whole call (host window in, host
  # output back; weights and state stay where the backend computes).
  alias FusedKernels.{Backbone, Sample}
  alias FusedKernels.Backbone.Spec

  def bench_cases(opts) do
    exphil =
      for mode <- [:window, :frame], batch <- [1, 8] do
        spec = Spec.new(:gru, layers: 1, window: 16)
        row("backbone gru1 w16 #{mode}#{suffix(batch)}", spec, mode, batch)
      end

    rows =
      for kind <- Backbone.supported(), mode <- [:window, :frame], batch <- [1, 8] do
        spec = Spec.new(kind)

        dir = opts[:export]
        if batch == 1 and dir, do: export(dir, kind, Backbone.random_params(spec, 1))

        row("backbone #{kind} #{mode}#{suffix(batch)}", spec, mode, batch)
      end

    rows ++ exphil
  end

  defp suffix(1), do: ""
  defp suffix(b), do: " b#{b}"

  defp row(name, spec, mode, batch) do
    params = Backbone.random_params(spec, 1)
    shape = if mode == :window, do: {batch, spec.window, spec.embed}, else: {batch, spec.embed}

    %{
      name: name,
      shape: shape,
      type: {:f, 32},
      runner: &runner(&1, spec, params, mode, shape)
    }
  end

  # Params plus one window and our CPU output for it, so the PyTorch side can check that
  # it computes the same function before timing it.
  defp export(dir, kind, params) do
    File.mkdir_p!(dir)
    Backbone.export_params(params, Path.join(dir, "#{kind}_params"))
    spec = Spec.new(kind)
    {bin, _, _} = win = Sample.random_triple({1, spec.window, spec.embed}, {:f, 32})
    {out, _, _} = Backbone.predict(Backbone.load(spec, params, backend: :cpu), win)
    File.write!(Path.join(dir, "#{kind}_window.bin"), bin)
    File.write!(Path.join(dir, "#{kind}_out.bin"), out)
  end

  defp runner(backend, spec, params, mode, shape) when backend in [:cuda, :cpu, :nx] do
    params = if backend == :nx, do: to_nx(params), else: params
    handle = Backbone.load(spec, params, backend: backend)
    x = Sample.random_triple(shape, {:f, 32})
    x = if backend == :nx, do: to_nx(x), else: x

    case mode do
      :window ->
        fn -> Backbone.predict(handle, x) end

      :frame ->
        state = Backbone.init_state(handle, elem(shape, 0))
        fn -> Backbone.step(handle, state, x) end
    end
  end

  defp runner(_backend, _spec, _params, _mode, _shape), do: nil

  defp to_nx(%{} = m) when not is_struct(m), do: Map.new(m, fn {k, v} -> {k, to_nx(v)} end)
  defp to_nx(triple), do: apply(FusedKernels.Tensor, :to_nx, [triple])
end
