if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.XLA.Ops do
    @moduledoc false
    # The top-level fused ops (`FusedKernels.layer_norm/4`, `dense/4`, `selective_scan/6`, ...)
    # inside `defn`: one XLA custom call each (`FusedKernels.Axon.Call.exla/3`) when EXLA's
    # `EXLA.CustomCall` is loaded and the handlers serve the call, else `:skip` and the op
    # traces its pure-Nx implementation as before. The modules below are the ops in the form
    # `FusedKernels.XLA.run/3` and the pure-Nx gradient take (`nx_call/2`,
    # `output_template/2` of `FusedKernels.Op`; no `fused_call/2`: these never take the
    # runtime_call path). Inputs are one map of the tensors present (the residual, bias, ...
    # included, so that the pure-Nx gradient reaches them); options stay keywords.

    alias FusedKernels.Axon.Call

    @doc false
    @spec norm(:layer_norm | :rms_norm, [Nx.Tensor.t() | nil], keyword) :: term | :skip
    def norm(kind, [x, weight, bias], opts) do
      residual = opts[:residual]

      if residual == nil or is_struct(residual, Nx.Tensor) do
        ins = present(x: x, weight: weight, beta: bias, residual: residual)
        in_graph(__MODULE__.Norm, {ins}, kind: kind, eps: opts[:eps], backend: opts[:backend])
      else
        :skip
      end
    end

    @doc false
    @spec dense(atom, map, keyword) :: term | :skip
    def dense(kind, ops, opts) do
      if Enum.all?(ops, fn {_, t} -> t == nil or is_struct(t, Nx.Tensor) end) do
        o = [kind: kind] ++ Keyword.take(opts, [:activation, :eps, :backend])
        in_graph(__MODULE__.Dense, {present(Enum.to_list(ops))}, o)
      else
        :skip
      end
    end

    @doc false
    @spec selective_scan([Nx.Tensor.t()], keyword) :: term | :skip
    def selective_scan([u, delta, a, b, c], opts) do
      optional = Keyword.take(opts, [:d, :z, :delta_bias, :initial_state])

      if Enum.all?(optional, fn {_, t} -> t == nil or is_struct(t, Nx.Tensor) end) do
        ins = present([u: u, delta: delta, a: a, b: b, c: c] ++ optional)

        o = Keyword.take(opts, [:delta_softplus, :return_last_state, :b_discretization, :backend])

        in_graph(__MODULE__.SelectiveScan, {ins}, o)
      else
        :skip
      end
    end

    @doc false
    @spec flash_attention(Nx.Tensor.t(), Nx.Tensor.t(), Nx.Tensor.t(), keyword) :: term | :skip
    def flash_attention(q, k, v, opts) do
      o = Keyword.take(opts, [:layout, :causal, :scale, :window, :backend])

      with {out, lse} <- in_graph(__MODULE__.FlashAttention, {q, k, v}, o),
           do: if(opts[:return_lse], do: {out, lse}, else: out)
    end

    @doc false
    @spec mamba_block(Nx.Tensor.t(), map | struct, keyword) :: term | :skip
    def mamba_block(x, params, opts) do
      params = if is_struct(params), do: Map.fetch!(params, :data), else: params
      in_graph(FusedKernels.Axon.Ops.MambaBlock, {x, params}, opts)
    end

    @doc false
    # `layers` as `FusedKernels.Rnn.layer_tensors/3` gives them; the result as
    # `FusedKernels.Rnn.nx/4`'s, `{sequence, [state tuple per layer]}`.
    @spec rnn(:lstm | :gru, Nx.Tensor.t(), list, keyword) :: term | :skip
    def rnn(cell, x, layers, opts) do
      tensors = for {a, b, c, d} <- layers, t <- a ++ b ++ c ++ d, do: t

      if Enum.all?(tensors, &is_struct(&1, Nx.Tensor)) do
        # The handler takes a state for every layer or for none: a layer without one starts
        # from zeros, as it does in the pure-Nx path.
        init? = Enum.any?(layers, fn {_, _, _, s} -> s != [] end)
        states = if cell == :lstm, do: 2, else: 1
        {batch, _, _} = Nx.shape(x)

        layers =
          for {wi, wh, bs, s} <- layers do
            units = elem(Nx.shape(hd(wh)), 0)
            zero = Nx.broadcast(Nx.tensor(0, type: Nx.type(x)), {batch, units})
            {wi, wh, bs, if(init? and s == [], do: List.duplicate(zero, states), else: s)}
          end

        weights =
          for {{wi, wh, bs, s}, l} <- Enum.with_index(layers),
              {part, list} <- [wi: wi, wh: wh, b: bs, s: s],
              {t, i} <- Enum.with_index(list),
              into: %{},
              do: {{l, part, i}, t}

        o =
          [cell: cell, layers: length(layers), initial_state: init?] ++
            Keyword.take(opts, [:reverse, :backend])

        with {seq, states} <- in_graph(__MODULE__.Rnn, {x, weights}, o),
             do: {seq, Tuple.to_list(states)}
      else
        :skip
      end
    end

    # Only traced calls (some input symbolic) become custom calls; a concrete call outside
    # `defn` that reached the pure-Nx path stays there.
    defp in_graph(op, inputs, opts) do
      if inputs |> flatten() |> Enum.any?(&FusedKernels.Tensor.symbolic?/1),
        do: Call.exla(op, inputs, opts),
        else: :skip
    end

    defp present(pairs), do: for({k, t} <- pairs, t != nil, into: %{}, do: {k, t})

    defp flatten(container), do: Nx.Defn.Composite.flatten_list([container])

    defmodule Norm do
      @moduledoc false
      # inputs: {%{x:, weight:, beta: (layer_norm, optional), residual: (optional)}};
      # opts: kind, eps. With a residual the result is {normed, x + residual}.

      @spec nx_call(tuple, keyword) :: term
      def nx_call({ins}, opts),
        do:
          FusedKernels.Norm.nx(opts[:kind], ins.x, ins.weight, ins[:beta],
            eps: opts[:eps],
            residual: ins[:residual]
          )

      @spec output_template(tuple, keyword) :: term
      def output_template({ins}, _opts) do
        y = Nx.template(Nx.shape(ins.x), Nx.type(ins.x))
        if ins[:residual], do: {y, y}, else: y
      end
    end

    defmodule Dense do
      @moduledoc false
      # inputs: {%{x:, kernel:, kernel_up:, bias:, bias_up:, gamma:, beta:, residual:}} (the
      # slots present); opts: kind (:dense, :swiglu, :rms_norm_dense, :layer_norm_dense),
      # activation, eps.

      @spec nx_call(tuple, keyword) :: term
      def nx_call({ops}, opts),
        do: FusedKernels.Dense.nx(opts[:kind], ops, Keyword.take(opts, [:activation, :eps]))

      @spec output_template(tuple, keyword) :: term
      def output_template({%{x: x, kernel: k}}, _opts),
        do:
          Nx.template(
            x |> Nx.shape() |> put_elem(Nx.rank(x) - 1, elem(Nx.shape(k), 1)),
            Nx.type(x)
          )
    end

    defmodule SelectiveScan do
      @moduledoc false
      # inputs: {%{u:, delta:, a:, b:, c:, d:, z:, delta_bias:, initial_state:}} (those
      # present); opts: delta_softplus, return_last_state, b_discretization.

      @optional [:d, :z, :delta_bias, :initial_state]

      @spec nx_call(tuple, keyword) :: term
      def nx_call({ins}, opts),
        do:
          FusedKernels.SelectiveScan.nx(
            ins.u,
            ins.delta,
            ins.a,
            ins.b,
            ins.c,
            Keyword.delete(opts, :backend) ++ Map.to_list(Map.take(ins, @optional))
          )

      @spec output_template(tuple, keyword) :: term
      def output_template({ins}, opts) do
        y = Nx.template(Nx.shape(ins.u), Nx.type(ins.u))
        {batch, _seq, dim} = Nx.shape(ins.u)
        state = elem(Nx.shape(ins.a), 1)

        if opts[:return_last_state],
          do: {y, Nx.template({batch, dim, state}, {:f, 32})},
          else: y
      end
    end

    defmodule Rnn do
      @moduledoc false
      # inputs: {x, %{{layer, :wi | :wh | :b | :s, index} => tensor}} (Axon's gate order,
      # `FusedKernels.Rnn.layer_tensors/3`); opts: cell, layers, initial_state, reverse.
      # Result: {sequence, {state tuple per layer}}.

      @spec nx_call(tuple, keyword) :: term
      def nx_call({x, weights}, opts) do
        {seq, states} =
          FusedKernels.Rnn.nx(opts[:cell], x, layers(weights, opts), opts[:reverse] || false)

        {seq, List.to_tuple(states)}
      end

      @spec output_template(tuple, keyword) :: term
      def output_template({x, weights}, opts) do
        {batch, seq, _} = Nx.shape(x)
        type = Nx.type(x)
        units = for {_, wh, _, _} <- layers(weights, opts), do: elem(Nx.shape(hd(wh)), 0)
        states = if opts[:cell] == :lstm, do: 2, else: 1
        state = fn u -> List.to_tuple(List.duplicate(Nx.template({batch, u}, type), states)) end
        {Nx.template({batch, seq, List.last(units)}, type), List.to_tuple(Enum.map(units, state))}
      end

      @doc false
      # The map's keys in the handler's operand order (after x): per layer its input
      # kernels, hidden kernels, biases, then its state.
      @spec operand_keys(map, keyword) :: list
      def operand_keys(weights, opts) do
        for {{wi, wh, bs, s}, l} <- Enum.with_index(layers(weights, opts)),
            {part, list} <- [wi: wi, wh: wh, b: bs, s: s],
            i <- 0..(length(list) - 1)//1,
            do: {l, part, i}
      end

      @doc false
      # The layers back from the map: [{wi, wh, biases, state}].
      @spec layers(map, keyword) :: list
      def layers(weights, opts) do
        for l <- 0..(opts[:layers] - 1) do
          part = fn p ->
            weights
            |> Enum.filter(fn {{wl, wp, _}, _} -> wl == l and wp == p end)
            |> Enum.sort()
            |> Enum.map(&elem(&1, 1))
          end

          {part.(:wi), part.(:wh), part.(:b), part.(:s)}
        end
      end
    end

    defmodule FlashAttention do
      @moduledoc false
      # The attention kernel alone (inputs {q, k, v}); its block returns out and lse (the
      # handler writes both); callers that do not want lse drop it.

      @spec nx_call(tuple, keyword) :: term
      def nx_call({q, k, v}, opts),
        do: FusedKernels.FlashAttention.nx(q, k, v, Keyword.put(opts, :return_lse, true))

      @spec output_template(tuple, keyword) :: term
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
