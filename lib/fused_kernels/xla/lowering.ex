if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.XLA.Lowering do
    @moduledoc false
    # How each fused op becomes one XLA FFI custom call (`FusedKernels.XLA.run/3`): the
    # target, its attributes, the operands in the handler's order with the types the
    # handler takes, and how the op's inputs are rebuilt from those operands for the block's
    # default (pure-Nx) body. `:skip` where the handler does not serve the call; the op then
    # takes its next path (Nx.runtime_call, or pure Nx).

    alias FusedKernels.XLA
    alias FusedKernels.XLA.Block

    @activations [:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh]
    @dense_slots [:x, :kernel, :kernel_up, :bias, :bias_up, :gamma, :beta, :residual]
    @scan_slots [:u, :delta, :a, :b, :c, :d, :z, :delta_bias, :initial_state]
    @scan_f32 [:a, :d, :delta_bias, :initial_state]

    @doc false
    @spec describe(module, tuple, keyword) :: {:ok, struct, list, function} | :skip
    def describe(op, inputs, opts)

    def describe(FusedKernels.Axon.Ops.LayerNorm, {x, gamma, beta}, opts) do
      type = Nx.type(x)

      with true <- XLA.served_type?(type) do
        f32 = {:f, 32}

        block = %Block{
          target: "fused_kernels_layer_norm",
          attributes: [
            {"eps", XLA.attr_float(Keyword.get(opts, :epsilon, 1.0e-5))},
            operands(~w(x gamma beta))
          ],
          operand_types: [type, f32, f32]
        }

        {:ok, block, [x, gamma, beta], fn [x, g, b] -> {x, g, b} end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.Axon.Ops.Dense, {ops}, opts),
      do: dense(:dense, ops, Keyword.get(opts, :activation, :none) || :none, nil)

    def describe(XLA.Ops.Dense, {ops}, opts) do
      activation = if opts[:kind] == :swiglu, do: :none, else: opts[:activation] || :none
      dense(opts[:kind], ops, activation, opts[:eps])
    end

    def describe(XLA.Ops.Norm, {ins}, opts) do
      type = Nx.type(ins.x)
      f32 = {:f, 32}
      cols = elem(Nx.shape(ins.x), Nx.rank(ins.x) - 1)

      with true <- XLA.served_type?(type) do
        # The handler's LayerNorm takes beta; a call without one adds zeros, as the kernel does.
        {target, slots} =
          case opts[:kind] do
            :layer_norm ->
              {"fused_kernels_layer_norm",
               [x: "x", weight: "gamma", beta: "beta", residual: "residual"]}

            :rms_norm ->
              {"fused_kernels_rms_norm", [x: "x", weight: "weight", residual: "residual"]}
          end

        ins2 =
          if opts[:kind] == :layer_norm and ins[:beta] == nil,
            do: Map.put(ins, :beta, Nx.broadcast(Nx.tensor(0.0, type: f32), {cols})),
            else: ins

        slots = Enum.filter(slots, fn {key, _} -> Map.has_key?(ins2, key) end)
        keys = Keyword.keys(slots)

        block = %Block{
          target: target,
          attributes: [
            {"eps", XLA.attr_float(opts[:eps])},
            operands(Keyword.values(slots))
          ],
          # The kernels read the scale and shift in f32, the residual in x's type.
          operand_types: Enum.map(keys, &if(&1 in [:weight, :beta], do: f32, else: type))
        }

        {:ok, block, Enum.map(keys, &Map.fetch!(ins2, &1)),
         fn tensors -> {keys |> Enum.zip(tensors) |> Map.new() |> Map.take(Map.keys(ins))} end}
      else
        _ -> :skip
      end
    end

    def describe(XLA.Ops.SelectiveScan, {ins}, opts) do
      type = Nx.type(ins.u)
      f32 = {:f, 32}
      names = Enum.filter(@scan_slots, &Map.has_key?(ins, &1))

      # mamba_ssm's per-channel discretisation only (the handler has no mean-dt workspace).
      # (The kernels' limits, e.g. the state size, are the op's own: its checks raise the
      # same ArgumentError while the block's default body is traced.)
      with true <- XLA.served_type?(type),
           :per_channel <- opts[:b_discretization] || :per_channel do
        block = %Block{
          target: "fused_kernels_selective_scan",
          attributes: [
            {"delta_softplus", XLA.attr_bool(opts[:delta_softplus] || false)},
            operands(names)
          ],
          # u, delta, b, c, z in u's type; the per-channel constants and the state in f32.
          operand_types: Enum.map(names, &if(&1 in @scan_f32, do: f32, else: type))
        }

        by_name(block, names, ins)
      else
        _ -> :skip
      end
    end

    def describe(XLA.Ops.Rnn, {x, weights}, opts) do
      type = Nx.type(x)

      with true <- XLA.served_type?(type) do
        {batch, seq, features} = Nx.shape(x)
        {_, bits} = type
        keys = XLA.Ops.Rnn.operand_keys(weights, opts)

        units =
          for {_, wh, _, _} <- XLA.Ops.Rnn.layers(weights, opts), do: elem(Nx.shape(hd(wh)), 0)

        words = rnn_workspace_words(opts[:cell], div(bits, 8), batch, seq, features, units)

        block = %Block{
          target: "fused_kernels_#{opts[:cell]}",
          attributes: [
            {"initial_state", XLA.attr_bool(opts[:initial_state])},
            {"layers", XLA.attr_int(opts[:layers])},
            {"reverse", XLA.attr_bool(opts[:reverse] || false)}
          ],
          operand_types: List.duplicate(type, 1 + length(keys)),
          extra: [{{words}, {:f, 32}}]
        }

        {:ok, block, [x | Enum.map(keys, &Map.fetch!(weights, &1))],
         fn [x | tensors] -> {x, Map.new(Enum.zip(keys, tensors))} end}
      else
        _ -> :skip
      end
    end

    def describe(XLA.Ops.FlashAttention, {q, k, v}, opts) do
      type = Nx.type(q)
      {left, right} = opts[:window] || {-1, -1}

      with true <- XLA.served_type?(type),
           true <- Keyword.get(opts, :layout, :bshd) in [:bshd, :bhsd] do
        scale = if opts[:scale], do: [{"scale", XLA.attr_float(opts[:scale])}], else: []

        block = %Block{
          target: "fused_kernels_flash_attention",
          attributes:
            [
              {"causal", XLA.attr_bool(opts[:causal] || false)},
              {"layout", XLA.attr_string(Atom.to_string(Keyword.get(opts, :layout, :bshd)))},
              {"window_left", XLA.attr_int(left)},
              {"window_right", XLA.attr_int(right)}
            ] ++ scale,
          operand_types: [type, type, type]
        }

        {:ok, block, [q, k, v], fn [q, k, v] -> {q, k, v} end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.Axon.Layers.GRU, {x, h, ik, hk, bias}, _opts) do
      type = Nx.type(x)

      with true <- XLA.served_type?(type) do
        {:ok, rnn_block("fused_kernels_gru", :gru, 12, x, ik["wir"]),
         [x, ik["wir"], ik["wiz"], ik["win"], hk["whr"], hk["whz"], hk["whn"]] ++
           [bias["br"], bias["bz"], bias["bin"], bias["bhn"], h],
         fn [x, wir, wiz, win, whr, whz, whn, br, bz, bin, bhn, h] ->
           {x, h, %{"wir" => wir, "wiz" => wiz, "win" => win},
            %{"whr" => whr, "whz" => whz, "whn" => whn},
            %{"br" => br, "bz" => bz, "bin" => bin, "bhn" => bhn}}
         end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.Axon.Layers.LSTM, {x, c, h, ik, hk, bias}, _opts) do
      type = Nx.type(x)

      with true <- XLA.served_type?(type) do
        {:ok, rnn_block("fused_kernels_lstm", :lstm, 15, x, ik["wii"]),
         [x, ik["wii"], ik["wif"], ik["wig"], ik["wio"], hk["whi"], hk["whf"], hk["whg"]] ++
           [hk["who"], bias["bi"], bias["bf"], bias["bg"], bias["bo"], c, h],
         fn [x, wii, wif, wig, wio, whi, whf, whg, who, bi, bf, bg, bo, c, h] ->
           {x, c, h, %{"wii" => wii, "wif" => wif, "wig" => wig, "wio" => wio},
            %{"whi" => whi, "whf" => whf, "whg" => whg, "who" => who},
            %{"bi" => bi, "bf" => bf, "bg" => bg, "bo" => bo}}
         end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.Axon.Ops.MambaBlock, {x, params}, opts) do
      name = Keyword.get(opts, :name, "mamba_block")
      f32 = {:f, 32}
      get = fn layer, key -> get_in(params, ["#{name}_#{layer}", key]) end
      conv = get.("conv_dw_conv", "kernel")

      # The handler serves f32 blocks, Axon's conv layout {k, 1, inner} and the per-channel
      # discretisation; `a` is passed explicitly (Edifice's fixed A when the params lack it).
      with true <- Nx.type(x) == f32,
           :per_channel <- Keyword.get(opts, :b_discretization, :per_channel),
           %{} <- params["#{name}_norm"],
           {_k, 1, _inner} <- conv && Nx.shape(conv),
           {_, rank} <- shape_of(get.("ssm_dt_rank", "kernel")) do
        a = get.("ssm", "a") || edifice_a(params, name)

        named =
          [
            {"x", x},
            {"norm_gamma", get.("norm", "gamma")},
            {"norm_beta", get.("norm", "beta")},
            {"in_kernel", get.("in_proj", "kernel")},
            {"in_bias", get.("in_proj", "bias")},
            {"conv_kernel", conv},
            {"conv_bias", get.("conv_dw_conv", "bias")},
            {"bc_kernel", get.("ssm_bc_proj", "kernel")},
            {"bc_bias", get.("ssm_bc_proj", "bias")},
            {"dt_rank_kernel", get.("ssm_dt_rank", "kernel")},
            {"dt_rank_bias", get.("ssm_dt_rank", "bias")},
            {"dt_proj_kernel", get.("ssm_dt_proj", "kernel")},
            {"dt_proj_bias", get.("ssm_dt_proj", "bias")},
            {"a", a},
            {"d", get.("ssm", "d")},
            {"out_kernel", get.("out_proj", "kernel")},
            {"out_bias", get.("out_proj", "bias")}
          ]
          |> Enum.reject(fn {_, t} -> is_nil(t) end)

        names = Enum.map(named, &elem(&1, 0))
        {batch, seq, hidden} = Nx.shape(x)
        {inner, state} = Nx.shape(a)

        block = %Block{
          target: "fused_kernels_mamba_block",
          attributes: [
            {"dt_max", XLA.attr_float(Keyword.get(opts, :dt_max, 0.1))},
            {"dt_min", XLA.attr_float(Keyword.get(opts, :dt_min, 0.001))},
            {"eps", XLA.attr_float(Keyword.get(opts, :eps, 1.0e-5))},
            operands(names),
            {"residual", XLA.attr_bool(Keyword.get(opts, :residual, true))}
          ],
          operand_types: List.duplicate(f32, length(named)),
          extra: [{{mamba_workspace_words(batch, seq, hidden, inner, state, rank)}, {:f, 32}}]
        }

        {:ok, block, Enum.map(named, &elem(&1, 1)),
         fn tensors -> {hd(tensors), mamba_params(name, Enum.zip(names, tensors))} end}
      else
        _ -> :skip
      end
    end

    def describe(_op, _inputs, _opts), do: :skip

    # The dense kinds: every operand in x's type (the kernels' rule); the norm-fused kinds
    # return each row's statistics as a second result (f32 {rows, 2}).
    defp dense(kind, ops, activation, eps) do
      x = ops.x
      type = Nx.type(x)
      names = Enum.filter(@dense_slots, &(Map.get(ops, &1) != nil))
      norm? = kind in [:rms_norm_dense, :layer_norm_dense]

      with true <- XLA.served_type?(type),
           true <- Nx.rank(x) >= 2,
           true <- activation in @activations do
        eps = if norm?, do: [{"eps", XLA.attr_float(eps)}], else: []
        rows = div(Nx.size(x), elem(Nx.shape(x), Nx.rank(x) - 1))

        block = %Block{
          target: "fused_kernels_dense",
          attributes:
            [{"activation", XLA.attr_string(Atom.to_string(activation))}] ++
              eps ++
              [
                {"kind", XLA.attr_string(Atom.to_string(kind))},
                operands(names)
              ],
          operand_types: List.duplicate(type, length(names)),
          extra: if(norm?, do: [{{rows, 2}, {:f, 32}}], else: [])
        }

        by_name(block, names, ops)
      else
        _ -> :skip
      end
    end

    # An op whose inputs are one map of named tensors (`{map}`): the block's operands are
    # the map's `names` in order, and the default body gets the map back.
    defp by_name(block, names, map) do
      {:ok, block, Enum.map(names, &Map.fetch!(map, &1)),
       fn tensors -> {Map.new(Enum.zip(names, tensors))} end}
    end

    defp operands(names),
      do: {"operands", XLA.attr_string(Enum.map_join(names, ",", &to_string/1))}

    # One layer with its initial state; x {batch, seq, features}, an input kernel {features,
    # units}.
    defp rnn_block(target, cell, operands, x, input_kernel) do
      type = Nx.type(x)
      {batch, seq, features} = Nx.shape(x)
      {_, units} = Nx.shape(input_kernel)
      {_, bits} = type

      %Block{
        target: target,
        attributes: [{"initial_state", XLA.attr_bool(true)}, {"layers", XLA.attr_int(1)}],
        operand_types: List.duplicate(type, operands),
        extra: [
          {{rnn_workspace_words(cell, div(bits, 8), batch, seq, features, [units])}, {:f, 32}}
        ]
      }
    end

    # The workspace lengths, in f32 words: the same bounds as the handlers'
    # (native/fused_kernels_xla/src/ops.rs, `rnn_workspace_words` and `mamba_workspace_words`):
    # the cuBLAS workspace, then every buffer the op may allocate, each started on a 256-byte
    # boundary, plus one spare.
    @cublas_workspace_bytes 4 * 1024 * 1024

    @doc false
    @spec rnn_workspace_words(:lstm | :gru, 2 | 4, pos_integer, non_neg_integer, pos_integer, [
            pos_integer
          ]) :: pos_integer
    def rnn_workspace_words(cell, elem, batch, seq, features, hidden) do
      {g, states} = if cell == :lstm, do: {4, 2}, else: {3, 1}

      {terms, _} =
        Enum.reduce(hidden, {[@cublas_workspace_bytes], features}, fn h, {acc, input} ->
          # The tensor-core paths' weight tiles: units padded to 16, K to 128 bytes, f32 lo plane.
          tiles = g * (h + 16) * (h + 64) * max(elem, 4)

          layer =
            [
              input * g * h * elem,
              batch * seq * g * h * 4,
              batch * seq * h * elem,
              h * g * h * elem,
              tiles,
              tiles,
              2 * batch * (h + 4) * 4 + 16,
              batch * g * h * 4,
              batch * h * 4,
              batch * 4,
              16
            ] ++ List.duplicate(batch * h * elem, states)

          {acc ++ layer, h}
        end)

      words_of(terms)
    end

    @doc false
    @spec mamba_workspace_words(
            pos_integer,
            non_neg_integer,
            pos_integer,
            pos_integer,
            pos_integer,
            pos_integer
          ) :: pos_integer
    def mamba_workspace_words(batch, seq, hidden, inner, state, rank) do
      m = batch * seq

      rows =
        Enum.map(
          [hidden, 2 * inner, inner, inner, 2 * state, rank, inner, inner, hidden, 1],
          &(m * &1 * 4)
        )

      words_of([@cublas_workspace_bytes | rows])
    end

    defp words_of(terms) do
      bytes = Enum.reduce(terms, 256, fn t, acc -> acc + div(t + 255, 256) * 256 end)
      div(bytes + 3, 4)
    end

    defp shape_of(nil), do: nil
    defp shape_of(t), do: Nx.shape(t)

    # Edifice's A: A[:, n] = -(n + 1), {inner, state}.
    defp edifice_a(params, name) do
      inner = params |> get_in(["#{name}_ssm_dt_proj", "kernel"]) |> Nx.shape() |> elem(1)

      state =
        params |> get_in(["#{name}_ssm_bc_proj", "kernel"]) |> Nx.shape() |> elem(1) |> div(2)

      Nx.iota({inner, state}, axis: 1, type: {:f, 32}) |> Nx.add(1) |> Nx.negate()
    end

    # The params map back from the handler's operand names (the default body's input).
    defp mamba_params(name, pairs) do
      layer = %{
        "norm_gamma" => {"norm", "gamma"},
        "norm_beta" => {"norm", "beta"},
        "in_kernel" => {"in_proj", "kernel"},
        "in_bias" => {"in_proj", "bias"},
        "conv_kernel" => {"conv_dw_conv", "kernel"},
        "conv_bias" => {"conv_dw_conv", "bias"},
        "bc_kernel" => {"ssm_bc_proj", "kernel"},
        "bc_bias" => {"ssm_bc_proj", "bias"},
        "dt_rank_kernel" => {"ssm_dt_rank", "kernel"},
        "dt_rank_bias" => {"ssm_dt_rank", "bias"},
        "dt_proj_kernel" => {"ssm_dt_proj", "kernel"},
        "dt_proj_bias" => {"ssm_dt_proj", "bias"},
        "a" => {"ssm", "a"},
        "d" => {"ssm", "d"},
        "out_kernel" => {"out_proj", "kernel"},
        "out_bias" => {"out_proj", "bias"}
      }

      Enum.reduce(pairs, %{}, fn
        {"x", _}, acc ->
          acc

        {n, t}, acc ->
          {l, key} = Map.fetch!(layer, n)
          Map.update(acc, "#{name}_#{l}", %{key => t}, &Map.put(&1, key, t))
      end)
    end
  end
end
