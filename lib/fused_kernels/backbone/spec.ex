defmodule FusedKernels.Backbone.Spec do
  @moduledoc """
  A backbone configuration. The defaults are ExPhil's published inference configuration:
  embed 288, hidden 256, 2 layers, window 60; attention 4 × 64 with a sliding window of 60 and
  post-norm FFN (GELU, 256); Mamba state 16, expand 2, conv 4, dt_rank 16; Jamba 6 layers with
  attention every 3rd (pre-norm, parameter-free QK LayerNorm).

  Parameter names (one params map for the Axon model, `load/3` and streaming):

    * all: `"input_proj"` (dense embed → hidden; attention, Mamba, Jamba), output = last position
    * `:lstm` / `:gru`: `"input_norm"`, then per layer l: `"rnn_l"` (Axon's LSTM/GRU params),
      `"rnn_l_norm"` (LayerNorm)
    * `:attention`: per layer l: `"attn_l_q"`, `"attn_l_k"`, `"attn_l_v"`, `"attn_l_out"` (dense),
      `"attn_l_norm"`, `"ffn_l_up"`, `"ffn_l_down"` (dense), `"ffn_l_norm"`
    * `:mamba`: per layer l: Edifice's Mamba block names with prefix `"mamba_l"`
    * `:jamba`: per layer l: `"jamba_l"` Mamba block, or (every `attn_every`-th) `"jamba_l_attn_norm"`,
      `"jamba_l_q"`, `"jamba_l_k"`, `"jamba_l_v"`, `"jamba_l_out"`
  """

  @kinds [:attention, :lstm, :gru, :mamba, :jamba]

  defstruct kind: :lstm,
            embed: 288,
            hidden: 256,
            layers: 2,
            window: 60,
            heads: 4,
            head_dim: 64,
            ffn: 256,
            state: 16,
            expand: 2,
            conv: 4,
            dt_rank: 16,
            attn_every: 3,
            norm_eps: 1.0e-6,
            mamba_norm_eps: 1.0e-5

  @type t :: %__MODULE__{}

  @doc "ExPhil's configuration of `kind`, with any field overridden."
  def new(kind, overrides \\ []) when kind in @kinds do
    layers = if kind == :jamba, do: 6, else: 2
    spec = struct!(__MODULE__, [kind: kind, layers: layers] ++ overrides)

    if spec.kind in [:attention, :jamba] and spec.heads * spec.head_dim != spec.hidden do
      raise ArgumentError,
            "heads × head_dim must equal hidden (#{spec.heads} × #{spec.head_dim} != #{spec.hidden})"
    end

    spec
  end

  def kinds, do: @kinds

  @doc """
  The layer plan of an attention, Mamba or Jamba backbone: `{:post_attention | :attention |
  :mamba, l}` in order (`:post_attention` is the attention backbone's post-norm block with its
  FFN, `:attention` Jamba's pre-norm attention).
  """
  def plan(%__MODULE__{kind: :attention, layers: n}), do: for(l <- 1..n, do: {:post_attention, l})
  def plan(%__MODULE__{kind: :mamba, layers: n}), do: for(l <- 1..n, do: {:mamba, l})

  def plan(%__MODULE__{kind: :jamba, layers: n} = spec),
    do: for(l <- 1..n, do: {if(jamba_attention?(spec, l), do: :attention, else: :mamba), l})

  @doc "Whether layer `l` (1-based) of a Jamba backbone is an attention layer."
  def jamba_attention?(%__MODULE__{attn_every: every}, l), do: rem(l, every) == 0
end
