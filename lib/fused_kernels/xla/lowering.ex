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
            {"operands", XLA.attr_string("x,gamma,beta")}
          ],
          operand_types: [type, f32, f32]
        }

        {:ok, block, [x, gamma, beta], fn [x, g, b] -> {x, g, b} end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.Axon.Ops.Dense, {ops}, opts) do
      type = Nx.type(ops.x)
      activation = Keyword.get(opts, :activation, :none) || :none

      # The handler's operand names, in the order the block passes them.
      names = Enum.filter([:x, :kernel, :bias, :residual], &(Map.get(ops, &1) != nil))

      with true <- XLA.served_type?(type),
           true <-
             activation in [:none, :relu, :gelu, :gelu_tanh, :silu, :sigmoid, :tanh] do
        block = %Block{
          target: "fused_kernels_dense",
          attributes: [
            {"activation", XLA.attr_string(Atom.to_string(activation))},
            {"kind", XLA.attr_string("dense")},
            {"operands", XLA.attr_string(Enum.map_join(names, ",", &Atom.to_string/1))}
          ],
          operand_types: List.duplicate(type, length(names))
        }

        {:ok, block, Enum.map(names, &Map.fetch!(ops, &1)),
         fn tensors -> {Map.new(Enum.zip(names, tensors))} end}
      else
        _ -> :skip
      end
    end

    def describe(FusedKernels.XLA.Lowering.FlashAttention, {q, k, v}, opts) do
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
            {"operands", XLA.attr_string(Enum.join(names, ","))},
            {"residual", XLA.attr_bool(Keyword.get(opts, :residual, true))}
          ],
          operand_types: List.duplicate(f32, length(named)),
          workspace: mamba_workspace_words(batch, seq, hidden, inner, state, rank)
        }

        {:ok, block, Enum.map(named, &elem(&1, 1)),
         fn tensors -> {hd(tensors), mamba_params(name, Enum.zip(names, tensors))} end}
      else
        _ -> :skip
      end
    end

    def describe(_op, _inputs, _opts), do: :skip

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
        workspace: rnn_workspace_words(cell, div(bits, 8), batch, seq, features, [units])
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

    defmodule FlashAttention do
      @moduledoc false
      # The attention kernel alone as an op (inputs {q, k, v}); its block returns out and lse
      # (the handler writes both), the layer keeps out.
      @behaviour FusedKernels.Op

      @impl FusedKernels.Op
      def fused_call({q, k, v}, opts),
        do: FusedKernels.FlashAttention.run(q, k, v, Keyword.put(opts, :return_lse, true))

      @impl FusedKernels.Op
      def nx_call({q, k, v}, opts),
        do: FusedKernels.FlashAttention.nx(q, k, v, Keyword.put(opts, :return_lse, true))

      @impl FusedKernels.Op
      def output_template({q, _k, _v}, opts) do
        {b, s, h, _} =
          if Keyword.get(opts, :layout, :bshd) == :bshd,
            do: Nx.shape(q),
            else: q |> Nx.shape() |> then(fn {b, h, s, d} -> {b, s, h, d} end)

        {Nx.template(Nx.shape(q), Nx.type(q)), Nx.template({b, h, s}, {:f, 32})}
      end
    end
  end
end
