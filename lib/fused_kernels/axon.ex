if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.Axon do
    @moduledoc """
    Fused kernels inside Axon models, with the same parameters.

      * `fuse/2` walks an existing model and swaps the implementation of every node it can
        serve, keeping names and parameters, so one params map runs either model:
        `Axon.lstm`/`Axon.gru` nodes (`:lstm`/`:gru`), Axon's own `:dense` nodes (as
        `x · kernel + bias`; an `activation:` stays Axon's separate node), Axon's `:layer_norm`
        nodes over the last axis where Axon's formula is ours (see below), and the nodes made
        by the builders here with `fused: false`.
      * Builders with Axon's (or Edifice's) parameters plus `fused: :auto | true | false`:
        `lstm/3,4`, `gru/3,4` (Axon's params and return shapes), `attention/2` (q/k/v/out
        projections, heads, causal/window), `mamba_block/2` (Edifice's layer names),
        `layer_norm/2` ("gamma"/"beta") and `dense/3` ("kernel"/"bias", fused activation and
        residual).

    Inside the graph the fused op runs through `Nx.runtime_call/4` on Nx ≥ 0.11 (gradients from
    the pure-Nx implementation, so training still works) and as the pure-Nx path on older Nx;
    see `FusedKernels.Axon.Call`. `fused: false` traces the pure-Nx implementation; `fused:
    true` raises at build time when the configuration has no fused kernel (never because a GPU
    is missing: then the pure path runs, logged once). Nodes with a non-default activation or
    gate, or with a mask, keep Axon's implementation.

    Types follow Axon's policy: parameters are stored in the policy's params type (f32) and
    reach the fused op cast to its compute type, like any Axon layer's; the output is cast to
    the policy's output type. The kernels compute in f32 inside for bf16/f16 operands.

    Axon's `:layer_norm` before 0.9 (0.6.1 and 0.8.x; Axon 0.9.0's changelog: "normalize logic
    error when calculating the scale") replaces `rsqrt(var + eps)` by `rsqrt(eps)` when
    `var < eps`; ours (and Axon 0.9's) is `rsqrt(var + eps)` always. `fuse/2` probes the
    installed Axon once and leaves its layer norms alone (reason `:axon_layer_norm_differs`)
    where the two differ; an Axon `channel_index` other than -1 is left too
    (`:not_last_axis`: our kernels normalize the last axis). An Axon `:dense` node is swapped
    as `x · kernel + bias`; its `activation:` is a separate Axon node and stays Axon's (use
    `dense/3` for the fused epilogue).
    """

    require Logger

    alias FusedKernels.Axon.Builders

    @fusable_ops [:lstm, :gru, :dense, :layer_norm]
    @own_ops %{
      fused_attention: :attention,
      fused_mamba_block: :mamba_block,
      fused_layer_norm: :layer_norm,
      fused_dense: :dense
    }
    @own_op_names Map.keys(@own_ops)

    defp layer_fun(:lstm), do: &FusedKernels.Axon.Layers.lstm/7
    defp layer_fun(:gru), do: &FusedKernels.Axon.Layers.gru/7

    @doc """
    Returns the model with every fusable node swapped. Options: `only:` / `except:` (lists of
    op names, e.g. `[:lstm]`, or node names). Logs what it swapped and what it left; use
    `fuse_with_report/2` to get that as data.
    """
    @spec fuse(Axon.t(), keyword) :: Axon.t()
    def fuse(%Axon{} = model, opts \\ []) do
      {model, report} = fuse_with_report(model, opts)

      Logger.info(
        "FusedKernels.Axon.fuse: swapped #{inspect(Enum.map(report.swapped, & &1.name))}, " <>
          "left #{inspect(Enum.map(report.left, &{&1.name, &1.reason}))}"
      )

      model
    end

    @doc "Like `fuse/2`, returning `{model, %{swapped: [...], left: [...]}}`."
    @spec fuse_with_report(Axon.t(), keyword) :: {Axon.t(), map}
    def fuse_with_report(%Axon{} = model, opts \\ []) do
      # `ids` (internal): restrict to these node ids, for the builders.
      opts = Keyword.validate!(opts, only: nil, except: [], ids: nil)
      {:ok, report} = Agent.start_link(fn -> %{swapped: [], left: []} end)

      fused =
        Axon.map_nodes(model, fn node ->
          case decide(node, opts) do
            {:swap, fun} ->
              Agent.update(report, &%{&1 | swapped: [entry(node) | &1.swapped]})
              %{node | op: fun}

            {:swap_opts, node_opts} ->
              Agent.update(report, &%{&1 | swapped: [entry(node) | &1.swapped]})
              %{node | opts: node_opts}

            {:leave, reason} ->
              Agent.update(
                report,
                &%{&1 | left: [Map.put(entry(node), :reason, reason) | &1.left]}
              )

              node

            :ignore ->
              node
          end
        end)

      result = Agent.get(report, & &1)
      Agent.stop(report)
      {fused, %{swapped: Enum.reverse(result.swapped), left: Enum.reverse(result.left)}}
    end

    defp entry(node),
      do: %{name: node_name(node), op: Map.get(@own_ops, node.op_name, node.op_name)}

    defp decide(%Axon.Node{op_name: op_name} = node, opts) when op_name in @own_op_names do
      cond do
        Keyword.get(node.opts, :fused, :auto) != false -> :ignore
        not selected?(node, @own_ops[op_name], opts) -> {:leave, :not_selected}
        true -> {:swap_opts, Keyword.put(node.opts, :fused, :auto)}
      end
    end

    defp decide(%Axon.Node{op_name: op_name} = node, opts) when op_name in @fusable_ops do
      node_opts = node.opts

      cond do
        not selected?(node, op_name, opts) -> {:leave, :not_selected}
        node.op != op_name -> {:leave, :custom_op}
        op_name in [:dense, :layer_norm] -> decide_axon(node)
        Keyword.get(node_opts, :activation, :tanh) != :tanh -> {:leave, :non_default_activation}
        Keyword.get(node_opts, :gate, :sigmoid) != :sigmoid -> {:leave, :non_default_gate}
        true -> {:swap, layer_fun(op_name)}
      end
    end

    defp decide(_node, _opts), do: :ignore

    defp selected?(node, kind, opts) do
      keys = [kind, node.op_name, node_name(node)]

      (is_nil(opts[:only]) or Enum.any?(keys, &(&1 in opts[:only]))) and
        not Enum.any?(keys, &(&1 in opts[:except])) and
        (is_nil(opts[:ids]) or node.id in opts[:ids] or node_name(node) in opts[:ids])
    end

    # Axon's dense: x · kernel (+ bias); its activation is a separate node.
    defp decide_axon(%Axon.Node{op_name: :dense, parameters: params}),
      do: {:swap, Function.capture(Builders, :dense_layer, length(params) + 2)}

    defp decide_axon(%Axon.Node{op_name: :layer_norm, opts: node_opts}) do
      cond do
        Keyword.get(node_opts, :channel_index, -1) != -1 -> {:leave, :not_last_axis}
        not same_layer_norm?() -> {:leave, :axon_layer_norm_differs}
        true -> {:swap, &Builders.layer_norm_layer/4}
      end
    end

    @doc false
    # Whether the installed Axon's layer_norm is rsqrt(var + eps) for var < eps too (Axon >= 0.7;
    # 0.6 clips to rsqrt(eps)). Probed once on a row whose variance (1e-6) is under eps (1e-5).
    @spec same_layer_norm?() :: boolean
    def same_layer_norm? do
      key = {__MODULE__, :same_layer_norm}

      case :persistent_term.get(key, nil) do
        nil ->
          x = Nx.tensor([[0.0, 2.0e-3]], backend: Nx.BinaryBackend)
          {g, b} = {Nx.tensor([1.0, 1.0]), Nx.tensor([0.0, 0.0])}
          axon = Axon.Layers.layer_norm(x, g, b, epsilon: 1.0e-5)
          ours = FusedKernels.Norm.nx(:layer_norm, x, g, b, eps: 1.0e-5)
          same = Nx.all_close(axon, ours, rtol: 1.0e-4) |> Nx.to_number() == 1
          :persistent_term.put(key, same)
          same

        same ->
          same
      end
    end

    # Axon names nodes lazily (a function of the op and a counter); the given name when set.
    defp node_name(%Axon.Node{name: name}) when is_binary(name), do: name

    defp node_name(%Axon.Node{name: name, op_name: op}) when is_function(name, 2),
      do: name.(op, %{})

    defp node_name(%Axon.Node{id: id, op_name: op}), do: "#{op}_#{id}"

    @doc """
    The initial state Axon gives the recurrent layer `name` (the `name:` of its `Axon.lstm/3`
    or `Axon.gru/3`) for the model's `inputs`: `{c, h}` for an LSTM, `{h}` for a GRU, each
    `{batch, units}` f32. It is what `FusedKernels.lstm/3` / `gru/3` take as `initial_state:`,
    so they give the Axon model's numbers on every backend:

        {seq, _} = Axon.lstm(x, 64, name: "lstm")
        # ... params from Axon's init
        state = FusedKernels.Axon.initial_state(model, params, inputs, "lstm")
        FusedKernels.lstm(layer_x, params["lstm"], initial_state: state)

    Axon draws that state at random (`recurrent_initializer:`, `:glorot_uniform` by default,
    from a key in `params`), differently across Axon versions; this runs Axon's own state
    nodes of the model, so it matches the installed Axon and any initializer. `params` is
    Axon's params map or an `%Axon.ModelState{}`. The layer must have a `name:` and its own
    state (a layer given a state through `Axon.lstm/4` has none: pass that state instead).
    """
    @spec initial_state(Axon.t(), map | struct, term, String.t()) :: tuple
    def initial_state(%Axon{} = model, params, inputs, name) when is_binary(name) do
      nodes =
        Axon.reduce_nodes(model, %{}, fn
          %Axon.Node{op_name: :recurrent_state} = node, acc ->
            Map.put(acc, node_name(node), node.id)

          _node, acc ->
            acc
        end)

      ids =
        case {nodes["#{name}_c_hidden_state"], nodes["#{name}_h_hidden_state"]} do
          {nil, nil} ->
            raise ArgumentError,
                  "name: no recurrent layer named #{inspect(name)} with an initial state of " <>
                    "its own in this model (found #{inspect(Map.keys(nodes))}); name the " <>
                    "layer (Axon.lstm(x, units, name: ...)) and pass that name"

          {nil, h} ->
            [h]

          {c, h} ->
            [c, h]
        end

      ids
      |> Enum.map(fn id ->
        {_init, predict} = Axon.build(%{model | output: id})
        predict.(params, inputs)
      end)
      |> List.to_tuple()
    end

    def initial_state(model, _params, _inputs, name) do
      raise ArgumentError,
            "initial_state/4 takes an %Axon{} model and a layer name (a string), got: " <>
              "#{inspect(model, limit: 3)}, #{inspect(name, limit: 3)}"
    end

    @doc "`Axon.lstm/3` (random initial state) with `fused: :auto | true | false`."
    @spec lstm(Axon.t(), pos_integer, keyword) :: {Axon.t(), Axon.t()}
    def lstm(%Axon{} = x, units, opts) when is_integer(units), do: build(:lstm, [x, units], opts)

    @doc "`Axon.lstm/4` (given initial state) with `fused:`."
    @spec lstm(Axon.t(), Axon.t() | tuple, pos_integer, keyword) :: {Axon.t(), Axon.t()}
    def lstm(%Axon{} = x, hidden_state, units, opts),
      do: build(:lstm, [x, hidden_state, units], opts)

    @doc "`Axon.gru/3` with `fused:`."
    @spec gru(Axon.t(), pos_integer, keyword) :: {Axon.t(), Axon.t()}
    def gru(%Axon{} = x, units, opts) when is_integer(units), do: build(:gru, [x, units], opts)

    @doc "`Axon.gru/4` with `fused:`."
    @spec gru(Axon.t(), Axon.t() | tuple, pos_integer, keyword) :: {Axon.t(), Axon.t()}
    def gru(%Axon{} = x, hidden_state, units, opts),
      do: build(:gru, [x, hidden_state, units], opts)

    @doc """
    Multi-head self-attention on `{batch, seq, embed}` → `{batch, seq, units}`: q/k/v dense
    projections, `FusedKernels.flash_attention/4`, an output projection.

    Options: `name:` (default "attention"), `heads:` and `head_dim:` (required), `kv_heads:`
    (GQA, default heads), `causal:` (false), `window:` (nil, a size n for the last n positions
    — Edifice's `window_size` — or FlashAttention's `{left, right}`), `scale:` (default
    head_dim^-0.5), `qkv: :separate` (layers "<name>_q", "<name>_k", "<name>_v") or `:packed`
    (one "<name>_qkv" layer, Edifice's), `output: true` ("<name>_out"), a layer name (Edifice's
    self_attention: "<name>_output") or `false` (none, Edifice's sliding_window_attention),
    `units:` (the output width, default heads × head_dim), `use_bias:` (true), `fused:`.
    Every projection is Axon.dense-shaped: `%{"kernel" => {in, out}, "bias" => {out}}`.
    """
    @spec attention(Axon.t(), keyword) :: Axon.t()
    defdelegate attention(x, opts), to: Builders

    @doc """
    Edifice's Mamba block (`Edifice.SSM.Common.build_block` with the selective scan), with its
    layer names: "<name>_norm", "<name>_in_proj", "<name>_conv_dw_conv", "<name>_ssm_bc_proj",
    "<name>_ssm_dt_rank", "<name>_ssm_dt_proj", "<name>_out_proj" — so its checkpoints load.

    Options: `name:` (default "mamba_block"; Edifice's are "mamba_block_<i>"), `hidden_size:`
    (required), `state_size:` (16), `expand_factor:` (2), `conv_size:` (4), `dt_rank:` (hidden/16),
    `eps:` (1e-5), `dt_min:`/`dt_max:` (0.001/0.1), `b_discretization:` (`:per_channel`, mamba_ssm's
    and Edifice's CUDA path; `:mean_dt` for Edifice's pure-Nx scan), `residual:` (false; Edifice
    adds the residual as its own node), `fused:`.
    """
    @spec mamba_block(Axon.t(), keyword) :: Axon.t()
    defdelegate mamba_block(x, opts), to: Builders

    @doc """
    LayerNorm over the last axis with Axon's parameters ("gamma", "beta"). Options: `name:`,
    `epsilon:` (1e-5), `gamma_initializer:` (:ones), `beta_initializer:` (:zeros), `fused:`.
    """
    @spec layer_norm(Axon.t(), keyword) :: Axon.t()
    defdelegate layer_norm(x, opts \\ []), to: Builders

    @doc """
    `act(x · kernel + bias) + residual` as one node with Axon.dense's parameters ("kernel",
    "bias"). Options: `name:`, `activation:` (nil, :relu, :gelu, :gelu_tanh, :silu, :sigmoid,
    :tanh), `residual:` (an Axon node of the output's shape), `use_bias:`, initializers, `fused:`.
    """
    @spec dense(Axon.t(), pos_integer, keyword) :: Axon.t()
    defdelegate dense(x, units, opts \\ []), to: Builders

    defp build(op, args, opts) do
      {fused, opts} = Keyword.pop(opts, :fused, :auto)

      unless fused in [:auto, true, false],
        do: raise(ArgumentError, "fused must be :auto, true or false, got: #{inspect(fused)}")

      {seq, state} = apply(Axon, op, args ++ [opts])

      if fused == false do
        {seq, state}
      else
        if fused == true and not fusable_opts?(opts) do
          raise ArgumentError,
                "fused: true needs the default activation (:tanh) and gate (:sigmoid), got: " <>
                  inspect(Keyword.take(opts, [:activation, :gate]))
        end

        ids = new_nodes(hd(args), seq, op)
        swap = &(&1 |> fuse_with_report(ids: ids) |> elem(0))
        {swap.(seq), map_state(state, swap)}
      end
    end

    defp fusable_opts?(opts),
      do:
        Keyword.get(opts, :activation, :tanh) == :tanh and
          Keyword.get(opts, :gate, :sigmoid) == :sigmoid

    # The nodes of `op` this builder added (not those already upstream in x).
    defp new_nodes(%Axon{nodes: before}, %Axon{nodes: after_}, op) do
      for {id, %Axon.Node{op_name: ^op} = node} <- after_,
          not Map.has_key?(before, id),
          do: node_name(node)
    end

    defp map_state(state, fun) when is_tuple(state),
      do: state |> Tuple.to_list() |> Enum.map(&map_state(&1, fun)) |> List.to_tuple()

    defp map_state(%Axon{} = a, fun), do: fun.(a)
  end
end
