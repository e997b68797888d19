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

    def build(%Spec{kind: kind} = spec) when kind in [:attention, :mamba, :jamba] do
      input = Axon.input("frames", shape: {nil, spec.window, spec.embed})
      x = Axon.dense(input, spec.hidden, name: "input_proj")

      x =
        Enum.reduce(FusedKernels.Backbone.Spec.plan(spec), x, fn
          {:post_attention, l}, x ->
            post_attention(spec, x, l)

          {:attention, l}, x ->
            pre_attention(spec, x, l)

          {:mamba, l}, x ->
            mamba(spec, x, if(kind == :jamba, do: "jamba_#{l}", else: "mamba_#{l}"))
        end)

      Axon.nx(x, &last/1, name: "last")
    end

    # x + attn(x) -> LayerNorm -> FFN (GELU) -> + -> LayerNorm.
    defp post_attention(spec, x, l) do
      a = attention(spec, x, "attn_#{l}", false)
      x1 = Axon.layer_norm(Axon.add(x, a), name: "attn_#{l}_norm", epsilon: spec.norm_eps)

      f =
        x1
        |> Axon.dense(spec.ffn, name: "ffn_#{l}_up", activation: :gelu)
        |> Axon.dense(spec.hidden, name: "ffn_#{l}_down")

      Axon.layer_norm(Axon.add(x1, f), name: "ffn_#{l}_norm", epsilon: spec.norm_eps)
    end

    # Jamba's pre-norm attention block with parameter-free QK LayerNorm.
    defp pre_attention(spec, x, l) do
      xn = Axon.layer_norm(x, name: "jamba_#{l}_attn_norm", epsilon: spec.norm_eps)
      Axon.add(x, attention(spec, xn, "jamba_#{l}", true))
    end

    defp attention(spec, x, prefix, qk_norm) do
      [q, k, v] = for n <- ~w(q k v), do: Axon.dense(x, spec.hidden, name: "#{prefix}_#{n}")

      Axon.layer(&FusedKernels.Backbone.NxPath.attention/4, [q, k, v],
        name: "#{prefix}_attention",
        op_name: :sliding_window_attention,
        heads: spec.heads,
        window: spec.window,
        qk_norm: qk_norm
      )
      |> Axon.dense(spec.hidden, name: "#{prefix}_out")
    end

    # Edifice's Mamba block from Axon layers (so its parameter names are the layers' names),
    # the selective scan as an `Axon.layer` around the pure-Nx scan; residual around it.
    defp mamba(spec, x, name) do
      inner = spec.expand * spec.hidden
      n = spec.state

      xz =
        x
        |> Axon.layer_norm(name: "#{name}_norm", epsilon: spec.mamba_norm_eps)
        |> Axon.dense(2 * inner, name: "#{name}_in_proj")

      xs = Axon.nx(xz, &Nx.slice_along_axis(&1, 0, inner, axis: 2), name: "#{name}_x")
      z = Axon.nx(xz, &Nx.slice_along_axis(&1, inner, inner, axis: 2), name: "#{name}_z")

      xc =
        xs
        |> Axon.conv(inner,
          kernel_size: spec.conv,
          padding: [{spec.conv - 1, 0}],
          feature_group_size: inner,
          name: "#{name}_conv_dw_conv"
        )
        |> Axon.activation(:silu, name: "#{name}_conv_silu")

      bc = Axon.dense(xc, 2 * n, name: "#{name}_ssm_bc_proj")

      dt =
        xc
        |> Axon.dense(spec.dt_rank, name: "#{name}_ssm_dt_rank")
        |> Axon.dense(inner, name: "#{name}_ssm_dt_proj")

      y = Axon.layer(&scan/5, [xc, dt, bc, z], name: "#{name}_ssm_scan", op_name: :selective_scan)
      Axon.add(x, Axon.dense(y, spec.hidden, name: "#{name}_out_proj"))
    end

    @doc false
    def scan(xc, dt, bc, z, _opts) do
      {_, _, inner} = Nx.shape(xc)
      n = div(elem(Nx.shape(bc), 2), 2)
      a = Nx.negate(Nx.add(Nx.iota({inner, n}, axis: 1, type: {:f, 32}), 1))

      FusedKernels.SelectiveScan.nx(
        xc,
        dt,
        a,
        Nx.slice_along_axis(bc, 0, n, axis: 2),
        Nx.slice_along_axis(bc, n, n, axis: 2),
        z: z,
        delta_softplus: true,
        delta_clip: {0.001, 0.1}
      )
    end

    @doc false
    def zeros(x, units),
      do: Nx.broadcast(Nx.tensor(0.0, type: Nx.type(x)), {Nx.axis_size(x, 0), units})

    @doc false
    def last(x),
      do: x |> Nx.slice_along_axis(Nx.axis_size(x, 1) - 1, 1, axis: 1) |> Nx.squeeze(axes: [1])
  end
end
