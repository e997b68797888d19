if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.Backbone.AxonModel do
    @moduledoc """
    ExPhil's backbones as plain Axon models (for training and for comparison), with the
    parameter names of `FusedKernels.Backbone.Spec`. Input `"frames"` `{batch, window, embed}`,
    output `{batch, hidden}` (the last position). Recurrent layers start from zero state.
    """

    alias FusedKernels.Backbone.Spec

    def build(%Spec{kind: kind} = spec) when kind in [:lstm, :gru] do
      input = Axon.input("frames", shape: {nil, spec.window, spec.embed})
      x = Axon.layer_norm(input, name: "input_norm", epsilon: spec.norm_eps)

      x =
        Enum.reduce(1..spec.layers, x, fn l, x ->
          zeros = Axon.nx(x, &zeros(&1, spec.hidden), name: "rnn_#{l}_zero_state")
          state = if kind == :lstm, do: {zeros, zeros}, else: {zeros}
          {seq, _} = apply(Axon, kind, [x, state, spec.hidden, [name: "rnn_#{l}"]])
          Axon.layer_norm(seq, name: "rnn_#{l}_norm", epsilon: spec.norm_eps)
        end)

      Axon.nx(x, &last/1, name: "last")
    end

    @doc false
    def zeros(x, units),
      do: Nx.broadcast(Nx.tensor(0.0, type: Nx.type(x)), {Nx.axis_size(x, 0), units})

    @doc false
    def last(x),
      do: x |> Nx.slice_along_axis(Nx.axis_size(x, 1) - 1, 1, axis: 1) |> Nx.squeeze(axes: [1])
  end
end
