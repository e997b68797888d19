if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.Axon.Builders do
    @moduledoc false
    # The Axon layers behind `FusedKernels.Axon.attention/2`, `mamba_block/2`, `layer_norm/2`
    # and `dense/3`. Each builds ONE compute node (op_name `:fused_*`) whose `fused:` option
    # picks the path at trace time: `false` traces the op's pure-Nx implementation,
    # `:auto`/`true` go through `FusedKernels.Axon.Call` (runtime_call on Nx >= 0.11).
    #
    # Multi-layer blocks keep the parameter names of the layers they replace (Axon.dense's
    # "kernel"/"bias" under "<name>_q", Edifice's "<name>_in_proj", ...): Axon keys parameters by
    # node name, so each of those layers is a small "parameter node" that returns its
    # parameters as a map, and the compute node takes those maps as inputs. Axon's policy casts
    # them like any parameter (f32 storage, the policy's compute type inside).

    alias FusedKernels.Axon.{Call, Ops}

    @fused_values [:auto, true, false]

    @doc false
    @spec fused_option!(keyword) :: {:auto | boolean, keyword}
    def fused_option!(opts) do
      {fused, opts} = Keyword.pop(opts, :fused, :auto)

      unless fused in @fused_values,
        do: raise(ArgumentError, "fused must be :auto, true or false, got: #{inspect(fused)}")

      {fused, opts}
    end

    @doc false
    # Runs `op` on `inputs` as the node's `fused:` option says.
    @spec run(module, tuple, keyword) :: term
    def run(op, inputs, opts) do
      {fused, opts} = Keyword.pop(opts, :fused, :auto)
      opts = Keyword.delete(opts, :mode)
      if fused == false, do: op.nx_call(inputs, opts), else: Call.run(op, inputs, opts)
    end

    # ---- parameter nodes ------------------------------------------------------------------

    # {key, shape_fun (of the input shape), initializer}
    defp param_node(x, name, specs) do
      params = for {key, shape, init} <- specs, do: Axon.param(key, shape, initializer: init)

      Axon.layer(layer_fun(:params_layer, length(params) + 2), [x | params],
        name: name,
        op_name: :fused_params,
        keys: Enum.map(specs, &elem(&1, 0))
      )
    end

    # `in_dim`: the kernel's rows, or :input for x's last dimension.
    defp dense_param_node(x, name, in_dim, units, use_bias) do
      rows = fn s -> if in_dim == :input, do: elem(s, tuple_size(s) - 1), else: in_dim end
      kernel = {"kernel", fn s -> {rows.(s), units} end, :glorot_uniform}
      bias = {"bias", fn _ -> {units} end, :zeros}
      param_node(x, name, if(use_bias, do: [kernel, bias], else: [kernel]))
    end

    # Axon calls a layer function with one argument per input plus opts.
    for n <- 1..4 do
      args = Macro.generate_arguments(n, __MODULE__)
      terms = List.duplicate(quote(do: term), n)

      @doc false
      @spec params_layer(term, unquote_splicing(terms), keyword) :: map
      def params_layer(_x, unquote_splicing(args), opts),
        do: Map.new(Enum.zip(opts[:keys], [unquote_splicing(args)]))
    end

    for n <- 1..9 do
      args = Macro.generate_arguments(n, __MODULE__)
      terms = List.duplicate(quote(do: term), n)

      @doc false
      @spec attention_layer(Nx.Tensor.t(), unquote_splicing(terms), keyword) :: term
      def attention_layer(x, unquote_splicing(args), opts),
        do:
          run(
            Ops.Attention,
            {x, Map.new(Enum.zip(opts[:roles], [unquote_splicing(args)]))},
            Keyword.delete(opts, :roles)
          )

      @doc false
      @spec mamba_layer(Nx.Tensor.t(), unquote_splicing(terms), keyword) :: term
      def mamba_layer(x, unquote_splicing(args), opts) do
        params =
          Map.new(Enum.zip(opts[:layers], [unquote_splicing(args)]), fn {suffix, p} ->
            {"#{opts[:block]}_#{suffix}", p}
          end)

        opts = opts |> Keyword.drop([:layers, :block]) |> Keyword.put(:name, opts[:block])
        run(Ops.MambaBlock, {x, params}, opts)
      end
    end

    @doc false
    @spec layer_norm_layer(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword) :: Nx.Tensor.t()
    def layer_norm_layer(x, gamma, beta, opts), do: run(Ops.LayerNorm, {x, gamma, beta}, opts)

    # dense: inputs [x, (residual), kernel, (bias)]; the options say which are there.
    @doc false
    @spec dense_layer(Nx.Tensor.t(), Nx.Tensor.t(), keyword) :: Nx.Tensor.t()
    def dense_layer(x, kernel, opts), do: dense_run([x, kernel], opts)
    @spec dense_layer(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword) :: Nx.Tensor.t()
    def dense_layer(x, a, b, opts), do: dense_run([x, a, b], opts)

    @spec dense_layer(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword) ::
            Nx.Tensor.t()
    def dense_layer(x, r, kernel, bias, opts), do: dense_run([x, r, kernel, bias], opts)

    defp dense_run([x | rest], opts) do
      {r, rest} = if opts[:residual], do: {hd(rest), tl(rest)}, else: {nil, rest}
      [kernel | bias] = rest
      ops = %{x: x, kernel: kernel}
      ops = if r, do: Map.put(ops, :residual, r), else: ops
      ops = if bias != [], do: Map.put(ops, :bias, hd(bias)), else: ops
      run(Ops.Dense, {ops}, Keyword.delete(opts, :residual))
    end

    defp layer_fun(fun, arity), do: Function.capture(__MODULE__, fun, arity)

    # ---- builders -------------------------------------------------------------------------

    @doc false
    @spec attention(Axon.t(), keyword) :: Axon.t()
    def attention(%Axon{} = x, opts) do
      {fused, opts} = fused_option!(opts)

      opts =
        Keyword.validate!(opts, [
          :name,
          :heads,
          :head_dim,
          :kv_heads,
          :scale,
          :units,
          causal: false,
          window: nil,
          qkv: :separate,
          output: true,
          use_bias: true
        ])

      name = opts[:name] || "attention"
      heads = opts[:heads] || raise ArgumentError, "attention: heads: is required"
      kv_heads = opts[:kv_heads] || heads
      d = opts[:head_dim] || raise ArgumentError, "attention: head_dim: is required"

      unless is_integer(heads) and is_integer(kv_heads) and rem(heads, kv_heads) == 0,
        do: raise(ArgumentError, "attention: heads must be a multiple of kv_heads")

      if fused == true and d > 256,
        do: raise(ArgumentError, "fused: true needs head_dim <= 256, got: #{d}")

      window = window!(opts[:window])
      bias? = opts[:use_bias]

      proj =
        case opts[:qkv] do
          :separate ->
            [
              {"q", dense_param_node(x, "#{name}_q", :input, heads * d, bias?)},
              {"k", dense_param_node(x, "#{name}_k", :input, kv_heads * d, bias?)},
              {"v", dense_param_node(x, "#{name}_v", :input, kv_heads * d, bias?)}
            ]

          :packed ->
            [
              {"qkv",
               dense_param_node(x, "#{name}_qkv", :input, (heads + 2 * kv_heads) * d, bias?)}
            ]

          other ->
            raise ArgumentError, "qkv must be :separate or :packed, got: #{inspect(other)}"
        end

      out =
        case opts[:output] do
          false ->
            []

          out_name ->
            out_name = if is_binary(out_name), do: out_name, else: "#{name}_out"
            units = opts[:units] || heads * d
            # The output projection's input is the attention output (heads * head_dim wide).
            [{"out", dense_param_node(x, out_name, heads * d, units, bias?)}]
        end

      roles = proj ++ out

      Axon.layer(
        layer_fun(:attention_layer, length(roles) + 2),
        [x | Enum.map(roles, &elem(&1, 1))],
        name: name,
        op_name: :fused_attention,
        roles: Enum.map(roles, &elem(&1, 0)),
        heads: heads,
        kv_heads: kv_heads,
        causal: opts[:causal],
        window: window,
        scale: opts[:scale],
        fused: fused
      )
    end

    defp window!(nil), do: {-1, -1}
    defp window!(n) when is_integer(n) and n > 0, do: {n - 1, 0}
    defp window!({l, r} = w) when is_integer(l) and is_integer(r) and l >= -1 and r >= -1, do: w

    defp window!(other),
      do:
        raise(
          ArgumentError,
          "window must be nil, a positive size (the last n positions) or {left, right}, got: #{inspect(other)}"
        )

    @mamba_layers ~w(norm in_proj conv_dw_conv ssm_bc_proj ssm_dt_rank ssm_dt_proj out_proj)

    @doc false
    @spec mamba_block(Axon.t(), keyword) :: Axon.t()
    def mamba_block(%Axon{} = x, opts) do
      {fused, opts} = fused_option!(opts)

      opts =
        Keyword.validate!(opts, [
          :name,
          :hidden_size,
          state_size: 16,
          expand_factor: 2,
          conv_size: 4,
          dt_rank: nil,
          eps: 1.0e-5,
          dt_min: 0.001,
          dt_max: 0.1,
          b_discretization: :per_channel,
          residual: false
        ])

      name = opts[:name] || "mamba_block"
      hidden = opts[:hidden_size] || raise ArgumentError, "mamba_block: hidden_size: is required"
      inner = hidden * opts[:expand_factor]
      n = opts[:state_size]
      rank = opts[:dt_rank] || max(div(hidden, 16), 1)
      k = opts[:conv_size]

      unless opts[:b_discretization] in [:per_channel, :mean_dt],
        do: raise(ArgumentError, "b_discretization must be :per_channel or :mean_dt")

      # Parameter shapes exactly as Edifice's Axon layers create them.
      holders = [
        param_node(x, "#{name}_norm", [
          {"gamma", fn _ -> {hidden} end, :ones},
          {"beta", fn _ -> {hidden} end, :zeros}
        ]),
        dense_param_node(x, "#{name}_in_proj", hidden, 2 * inner, true),
        param_node(x, "#{name}_conv_dw_conv", [
          {"kernel", fn _ -> {k, 1, inner} end, :glorot_uniform},
          {"bias", fn _ -> {inner} end, :zeros}
        ]),
        dense_param_node(x, "#{name}_ssm_bc_proj", inner, 2 * n, true),
        dense_param_node(x, "#{name}_ssm_dt_rank", inner, rank, true),
        dense_param_node(x, "#{name}_ssm_dt_proj", rank, inner, true),
        dense_param_node(x, "#{name}_out_proj", inner, hidden, true)
      ]

      Axon.layer(
        layer_fun(:mamba_layer, length(holders) + 2),
        [x | holders],
        name: name,
        op_name: :fused_mamba_block,
        layers: @mamba_layers,
        block: name,
        eps: opts[:eps],
        dt_min: opts[:dt_min],
        dt_max: opts[:dt_max],
        b_discretization: opts[:b_discretization],
        residual: opts[:residual],
        fused: fused
      )
    end

    @doc false
    @spec layer_norm(Axon.t(), keyword) :: Axon.t()
    def layer_norm(%Axon{} = x, opts) do
      {fused, opts} = fused_option!(opts)

      opts =
        Keyword.validate!(opts, [
          :name,
          epsilon: 1.0e-5,
          gamma_initializer: :ones,
          beta_initializer: :zeros
        ])

      last = fn s -> {elem(s, tuple_size(s) - 1)} end
      gamma = Axon.param("gamma", last, initializer: opts[:gamma_initializer])
      beta = Axon.param("beta", last, initializer: opts[:beta_initializer])

      Axon.layer(&__MODULE__.layer_norm_layer/4, [x, gamma, beta],
        name: opts[:name],
        op_name: :fused_layer_norm,
        epsilon: opts[:epsilon],
        fused: fused
      )
    end

    @activations [nil, :none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh]

    @doc false
    @spec dense(Axon.t(), pos_integer, keyword) :: Axon.t()
    def dense(%Axon{} = x, units, opts) when is_integer(units) and units > 0 do
      {fused, opts} = fused_option!(opts)

      opts =
        Keyword.validate!(opts, [
          :name,
          :activation,
          :residual,
          kernel_initializer: :glorot_uniform,
          bias_initializer: :zeros,
          use_bias: true
        ])

      act = opts[:activation]

      unless act in @activations,
        do:
          raise(
            ArgumentError,
            "activation must be one of #{inspect(@activations)} (the fused epilogues), got: #{inspect(act)}"
          )

      # Axon calls a parameter's shape function with one shape per layer input.
      shape = fn f -> if opts[:residual], do: fn s, _ -> f.(s) end, else: f end

      kernel =
        Axon.param("kernel", shape.(fn s -> {elem(s, tuple_size(s) - 1), units} end),
          initializer: opts[:kernel_initializer]
        )

      bias = Axon.param("bias", shape.(fn _ -> {units} end), initializer: opts[:bias_initializer])

      inputs =
        [x] ++
          if(r = opts[:residual], do: [r], else: []) ++
          [kernel] ++ if(opts[:use_bias], do: [bias], else: [])

      Axon.layer(layer_fun(:dense_layer, length(inputs) + 1), inputs,
        name: opts[:name],
        op_name: :fused_dense,
        activation: act || :none,
        residual: not is_nil(opts[:residual]),
        fused: fused
      )
    end
  end
end
