if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.BackboneAxonTest do
    # The fused backbones against the Axon model built from the same params.
    use ExUnit.Case, async: true
    @moduletag :axon

    alias FusedKernels.Backbone
    alias FusedKernels.Backbone.Spec

    @small [
      window: 7,
      embed: 24,
      hidden: 32,
      heads: 2,
      head_dim: 16,
      ffn: 32,
      state: 4,
      dt_rank: 4
    ]

    test "predict equals the Axon model on the same params, on every backend" do
      for kind <- Spec.kinds() do
        spec = Spec.new(kind, @small ++ if(kind == :jamba, do: [layers: 3], else: []))
        params = Backbone.random_params(spec, 9) |> to_nx()

        x =
          Nx.tensor(for(_ <- 1..(2 * 7 * 24), do: :rand.uniform() * 2 - 1), type: :f32)
          |> Nx.reshape({2, 7, 24})

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

    test "streaming the window from init_state equals predict on the :nx backend" do
      for kind <- [:attention, :mamba, :jamba] do
        spec = Spec.new(kind, @small ++ if(kind == :jamba, do: [layers: 3], else: []))
        handle = Backbone.load(spec, Backbone.random_params(spec, 2), backend: :nx)

        x =
          Nx.tensor(for(_ <- 1..(7 * 24), do: :rand.uniform() * 2 - 1), type: :f32)
          |> Nx.reshape({1, 7, 24})

        {out, _} =
          Enum.reduce(0..6, {nil, Backbone.init_state(handle, 1)}, fn i, {_, st} ->
            Backbone.step(handle, st, x[[.., i]])
          end)

        assert Nx.all_close(out, Backbone.predict(handle, x), atol: 1.0e-5, rtol: 1.0e-4)
               |> Nx.to_number() == 1,
               "#{kind}"
      end
    end

    defp to_nx(%{} = m), do: Map.new(m, fn {k, v} -> {k, to_nx(v)} end)
    defp to_nx(triple), do: FusedKernels.Tensor.to_nx(triple)
  end
end
