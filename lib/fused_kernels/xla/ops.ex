if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.XLA.Ops do
    @moduledoc false
    # The top-level fused ops (`FusedKernels.layer_norm/4`, `dense/4`, `selective_scan/6`, ...)
    # inside `defn`: one XLA custom call each (`FusedKernels.Axon.Call.exla/3`) when EXLA's
    # `EXLA.CustomCall` is loaded and the handlers serve the call, else `:skip` and the op
    # traces its pure-Nx implementation as before. The op modules below carry the inputs as
    # one map of the tensors present (the residual, bias, ... included, so that the pure-Nx
    # gradient reaches them); options stay keywords.

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
      @behaviour FusedKernels.Op

      @impl FusedKernels.Op
      def fused_call({ins}, opts),
        do: FusedKernels.Norm.run(opts[:kind], ins.x, ins.weight, ins[:beta], native(ins, opts))

      @impl FusedKernels.Op
      def nx_call({ins}, opts),
        do:
          FusedKernels.Norm.nx(opts[:kind], ins.x, ins.weight, ins[:beta],
            eps: opts[:eps],
            residual: ins[:residual]
          )

      @impl FusedKernels.Op
      def output_template({ins}, _opts) do
        y = Nx.template(Nx.shape(ins.x), Nx.type(ins.x))
        if ins[:residual], do: {y, y}, else: y
      end

      defp native(ins, opts),
        do: [eps: opts[:eps], residual: ins[:residual]] ++ native_backend(opts)

      defp native_backend(opts), do: FusedKernels.Axon.Ops.native_opts(opts)
    end

    defmodule Dense do
      @moduledoc false
      # inputs: {%{x:, kernel:, kernel_up:, bias:, bias_up:, gamma:, beta:, residual:}} (the
      # slots present); opts: kind (:dense, :swiglu, :rms_norm_dense, :layer_norm_dense),
      # activation, eps.
      @behaviour FusedKernels.Op

      @impl FusedKernels.Op
      def fused_call({ops}, opts) do
        o = Keyword.take(opts, [:activation, :eps]) ++ FusedKernels.Axon.Ops.native_opts(opts)

        case opts[:kind] do
          :dense ->
            FusedKernels.Dense.dense(
              ops.x,
              ops.kernel,
              ops[:bias],
              o ++ [residual: ops[:residual]]
            )

          :swiglu ->
            FusedKernels.Dense.swiglu(ops.x, ops.kernel, ops.kernel_up,
              bias_gate: ops[:bias],
              bias_up: ops[:bias_up],
              backend: o[:backend]
            )

          :rms_norm_dense ->
            FusedKernels.Dense.rms_norm_dense(
              ops.x,
              ops.gamma,
              ops.kernel,
              o ++ [bias: ops[:bias], residual: ops[:residual]]
            )

          :layer_norm_dense ->
            FusedKernels.Dense.layer_norm_dense(
              ops.x,
              ops.gamma,
              ops.beta,
              ops.kernel,
              o ++ [bias: ops[:bias], residual: ops[:residual]]
            )
        end
      end

      @impl FusedKernels.Op
      def nx_call({ops}, opts),
        do: FusedKernels.Dense.nx(opts[:kind], ops, Keyword.take(opts, [:activation, :eps]))

      @impl FusedKernels.Op
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
      @behaviour FusedKernels.Op

      @optional [:d, :z, :delta_bias, :initial_state]

      @impl FusedKernels.Op
      def fused_call({ins}, opts),
        do:
          FusedKernels.SelectiveScan.run(
            ins.u,
            ins.delta,
            ins.a,
            ins.b,
            ins.c,
            Keyword.delete(opts, :backend) ++
              Map.to_list(Map.take(ins, @optional)) ++ FusedKernels.Axon.Ops.native_opts(opts)
          )

      @impl FusedKernels.Op
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

      @impl FusedKernels.Op
      def output_template({ins}, opts) do
        y = Nx.template(Nx.shape(ins.u), Nx.type(ins.u))
        {batch, _seq, dim} = Nx.shape(ins.u)
        state = elem(Nx.shape(ins.a), 1)

        if opts[:return_last_state],
          do: {y, Nx.template({batch, dim, state}, {:f, 32})},
          else: y
      end
    end

    defmodule FlashAttention do
      @moduledoc false
      # The attention kernel alone (inputs {q, k, v}); its block returns out and lse (the
      # handler writes both); callers that do not want lse drop it.
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
