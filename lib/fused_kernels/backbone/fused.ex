defmodule FusedKernels.Backbone.Fused do
  @moduledoc false
  # The attention, Mamba and Jamba backbones on the native backends (:cuda, :cpu), composed
  # from the ops' Nx-free `native` entries. On :cuda every intermediate is a device buffer
  # (`out: :device`); on :cpu a host triple. State between frames:
  #   %{count: frames seen, layers: [{:attn, k_cache, v_cache} | {:mamba, conv, ssm}]}
  # with KV caches `{batch, window, heads, head_dim}` holding the newest frame last.

  alias FusedKernels.{Buffer, Dense, FlashAttention, MambaBlock, Native, Norm}
  alias FusedKernels.Backbone.Spec

  @doc "Layer plan: `{:attention | :post_attention | :mamba, l, name}` in order."
  def plan(%Spec{kind: :attention, layers: n}), do: for(l <- 1..n, do: {:post_attention, l})
  def plan(%Spec{kind: :mamba, layers: n}), do: for(l <- 1..n, do: {:mamba, l})

  def plan(%Spec{kind: :jamba, layers: n} = spec),
    do: for(l <- 1..n, do: {if(Spec.jamba_attention?(spec, l), do: :attention, else: :mamba), l})

  def predict(h, window) do
    x = dense(h, window, h.weights["input_proj"], [])

    Enum.reduce(plan(h.spec), x, fn layer, x ->
      {y, _} = layer(h, layer, x, nil)
      y
    end)
  end

  def init_state(h, batch) do
    s = h.spec
    zeros = &zeros(h, &1)

    layers =
      for {kind, _l} <- plan(s) do
        case kind do
          :mamba ->
            inner = s.expand * s.hidden
            {:mamba, zeros.({batch, s.conv - 1, inner}), zeros.({batch, inner, s.state})}

          _ ->
            shape = {batch, s.window, s.heads, s.head_dim}
            {:attn, zeros.(shape), zeros.(shape)}
        end
      end

    %{count: 0, layers: layers}
  end

  def step(h, %{count: count, layers: states}, frame) do
    count = count + 1
    x = dense(h, frame, h.weights["input_proj"], [])

    {x, states} =
      plan(h.spec)
      |> Enum.zip(states)
      |> Enum.map_reduce(x, fn {layer, st}, x ->
        {y, st2} = layer(h, layer, x, {count, st})
        {st2, y}
      end)
      |> then(fn {sts, x} -> {x, sts} end)

    {x, %{count: count, layers: states}}
  end

  # One layer on x {batch, seq, hidden}; `stream` nil (whole window) or {count, state}.
  defp layer(h, {:mamba, l}, x, stream) do
    name = if h.spec.kind == :jamba, do: "jamba_#{l}", else: "mamba_#{l}"
    opts = [name: name, eps: h.spec.mamba_norm_eps, residual: true] ++ call_opts(h)

    case stream do
      nil ->
        {MambaBlock.native(x, h.weights, opts), nil}

      {_, {:mamba, conv, ssm}} ->
        {y, conv, ssm} = MambaBlock.native_state(x, h.weights, conv, ssm, opts)
        {y, {:mamba, conv, ssm}}
    end
  end

  defp layer(h, {:post_attention, l}, x, stream) do
    w = h.weights
    p = fn n -> w["attn_#{l}_#{n}"] end
    {a, st} = attention(h, x, {p.("q"), p.("k"), p.("v")}, false, stream)
    x1 = norm(h, dense(h, a, p.("out"), residual: x), p.("norm"))
    f = dense(h, x1, w["ffn_#{l}_up"], activation: :gelu)
    {norm(h, dense(h, f, w["ffn_#{l}_down"], residual: x1), w["ffn_#{l}_norm"]), st}
  end

  defp layer(h, {:attention, l}, x, stream) do
    p = fn n -> h.weights["jamba_#{l}_#{n}"] end
    xn = norm(h, x, p.("attn_norm"))
    {a, st} = attention(h, xn, {p.("q"), p.("k"), p.("v")}, true, stream)
    {dense(h, a, p.("out"), residual: x), st}
  end

  # Multi-head attention core: projections, optional parameter-free QK LayerNorm, then causal
  # attention over the window (whole window) or over the KV cache (one frame).
  defp attention(h, x, {wq, wk, wv}, qk_norm?, stream) do
    s = h.spec
    {b, t, _} = shape(x)
    heads = {b, t, s.heads, s.head_dim}

    proj = fn w ->
      y = reshape(h, dense(h, x, w, []), heads)
      if qk_norm?, do: norm(h, y, h.weights["qk_norm"], 1.0e-6), else: y
    end

    {q, k, v} = {proj.(wq), proj.(wk), reshape(h, dense(h, x, wv, []), heads)}

    fa = fn q, k, v, left ->
      FlashAttention.native(q, k, v, [causal: true, window: {left, 0}] ++ call_opts(h))
    end

    {a, st} =
      case stream do
        nil ->
          {fa.(q, k, v, s.window - 1), nil}

        {count, {:attn, kc, vc}} ->
          kc = shift_append(h, kc, k)
          vc = shift_append(h, vc, v)
          {fa.(q, kc, vc, min(count, s.window) - 1), {:attn, kc, vc}}
      end

    {reshape(h, a, {b, t, s.hidden}), st}
  end

  defp dense(h, x, p, opts), do: Dense.dense(x, p["kernel"], p["bias"], opts ++ call_opts(h))

  defp norm(h, x, p, eps \\ nil) do
    eps = eps || h.spec.norm_eps
    Norm.native(:layer_norm, x, p["gamma"], p["beta"], [eps: eps] ++ call_opts(h))
  end

  defp shape(%Buffer{shape: s}), do: s
  defp shape({_, s, _}), do: s

  defp reshape(_h, {bin, _, type}, shape), do: {bin, shape, type}

  defp reshape(h, %Buffer{} = x, shape),
    do:
      x
      |> Map.fetch!(:ref)
      |> Native.stream_reshape(shape, :cuda, h.device, :device)
      |> Native.unwrap!()
      |> Buffer.wrap()

  defp shift_append(h, cache, row) do
    cache
    |> native_term()
    |> Native.stream_shift_append(native_term(row), h.backend, h.device, out(h))
    |> Native.unwrap!()
    |> Buffer.wrap()
  end

  defp native_term(%Buffer{ref: ref}), do: ref
  defp native_term(triple), do: triple

  defp out(%{backend: :cuda}), do: :device
  defp out(_), do: :host

  defp call_opts(h), do: [backend: h.backend, device: h.device, out: out(h)]

  defp zeros(h, shape) do
    triple = {:binary.copy(<<0.0::float-32-native>>, Tuple.product(shape)), shape, {:f, 32}}
    if h.backend == :cuda, do: Buffer.upload(triple, device: h.device), else: triple
  end
end
