if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Backbone.NxPath do
    @moduledoc false
    # The attention, Mamba and Jamba backbones in pure Nx (the `:nx` backend of
    # `FusedKernels.Backbone`), and the attention function the Axon model wraps in
    # `Axon.layer`. Layer plan from `FusedKernels.Backbone.Spec.plan/1`; state
    # `%{count: frames seen, layers: [{:attn, k_cache, v_cache} | {:mamba, conv, ssm}]}`.

    alias FusedKernels.{FlashAttention, MambaBlock, Norm}
    alias FusedKernels.Backbone.Spec

    def predict(spec, w, window) do
      x = dense(window, w["input_proj"])
      Enum.reduce(Spec.plan(spec), x, fn layer, x -> elem(layer(spec, w, layer, x, nil), 0) end)
    end

    def init_state(spec, batch) do
      inner = spec.expand * spec.hidden

      layers =
        for {kind, _} <- Spec.plan(spec) do
          if kind == :mamba,
            do:
              {:mamba, Nx.broadcast(0.0, {batch, spec.conv - 1, inner}),
               Nx.broadcast(0.0, {batch, inner, spec.state})},
            else:
              {:attn, Nx.broadcast(0.0, {batch, spec.window, spec.heads, spec.head_dim}),
               Nx.broadcast(0.0, {batch, spec.window, spec.heads, spec.head_dim})}
        end

      %{count: 0, layers: layers}
    end

    def step(spec, w, %{count: count, layers: states}, frame) do
      count = count + 1
      x = dense(Nx.new_axis(frame, 1), w["input_proj"])

      {states, x} =
        Spec.plan(spec)
        |> Enum.zip(states)
        |> Enum.map_reduce(x, fn {layer, st}, x ->
          {y, st2} = layer(spec, w, layer, x, {count, st})
          {st2, y}
        end)

      {Nx.squeeze(x, axes: [1]), %{count: count, layers: states}}
    end

    defp layer(spec, w, {:mamba, l}, x, stream) do
      name = if spec.kind == :jamba, do: "jamba_#{l}", else: "mamba_#{l}"
      opts = [name: name, eps: spec.mamba_norm_eps, residual: true]

      case stream do
        nil ->
          {MambaBlock.nx(x, w, opts), nil}

        {_, {:mamba, conv, ssm}} ->
          {y, {conv, ssm}} = MambaBlock.nx_with_state(x, w, {conv, ssm}, opts)
          {y, {:mamba, conv, ssm}}
      end
    end

    defp layer(spec, w, {:post_attention, l}, x, stream) do
      p = fn n -> w["attn_#{l}_#{n}"] end
      {a, st} = attention_layer(spec, x, {p.("q"), p.("k"), p.("v")}, false, stream)
      x1 = norm(Nx.add(x, dense(a, p.("out"))), p.("norm"), spec.norm_eps)
      f = dense(x1, w["ffn_#{l}_up"]) |> gelu()
      {norm(Nx.add(x1, dense(f, w["ffn_#{l}_down"])), w["ffn_#{l}_norm"], spec.norm_eps), st}
    end

    defp layer(spec, w, {:attention, l}, x, stream) do
      p = fn n -> w["jamba_#{l}_#{n}"] end
      xn = norm(x, p.("attn_norm"), spec.norm_eps)
      {a, st} = attention_layer(spec, xn, {p.("q"), p.("k"), p.("v")}, true, stream)
      {Nx.add(x, dense(a, p.("out"))), st}
    end

    defp attention_layer(spec, x, {wq, wk, wv}, qk_norm?, stream) do
      {q, k, v} = {dense(x, wq), dense(x, wk), dense(x, wv)}

      case stream do
        nil ->
          {attention(q, k, v, heads: spec.heads, window: spec.window, qk_norm: qk_norm?), nil}

        {count, {:attn, kc, vc}} ->
          {b, t, _} = Nx.shape(x)
          split = &Nx.reshape(&1, {b, t, spec.heads, spec.head_dim})
          {q4, k4} = {split.(q), split.(k)}
          {q4, k4} = if qk_norm?, do: {qk(q4), qk(k4)}, else: {q4, k4}
          kc = Nx.concatenate([kc[[.., 1..-1//1]], k4], axis: 1)
          vc = Nx.concatenate([vc[[.., 1..-1//1]], split.(v)], axis: 1)
          left = min(count, spec.window) - 1
          a = FlashAttention.nx(q4, kc, vc, causal: true, window: {left, 0})
          {Nx.reshape(a, {b, t, spec.hidden}), {:attn, kc, vc}}
      end
    end

    @doc """
    Causal multi-head attention over a `{batch, seq, heads * head_dim}` sequence with a
    sliding window, q/k/v already projected. Options: `heads`, `window`, `qk_norm`
    (parameter-free LayerNorm of q and k per head, eps 1e-6). Works inside `defn`/Axon.
    """
    def attention(q, k, v, opts) do
      {b, t, hid} = Nx.shape(q)
      heads = opts[:heads]
      split = &Nx.reshape(&1, {b, t, heads, div(hid, heads)})
      {q, k, v} = {split.(q), split.(k), split.(v)}
      {q, k} = if opts[:qk_norm], do: {qk(q), qk(k)}, else: {q, k}

      FlashAttention.nx(q, k, v, causal: true, window: {opts[:window] - 1, 0})
      |> Nx.reshape({b, t, hid})
    end

    defp qk(x) do
      d = elem(Nx.shape(x), 3)
      Norm.nx(:layer_norm, x, Nx.broadcast(1.0, {d}), Nx.broadcast(0.0, {d}), eps: 1.0e-6)
    end

    defp dense(x, p), do: Nx.add(Nx.dot(x, p["kernel"]), p["bias"])
    defp norm(x, p, eps), do: Norm.nx(:layer_norm, x, p["gamma"], p["beta"], eps: eps)

    # Axon's :gelu (the exact, erf form).
    defp gelu(x),
      do: Nx.multiply(Nx.multiply(x, 0.5), Nx.add(Nx.erf(Nx.divide(x, :math.sqrt(2))), 1))
  end
end
