if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Axon.Ops do
    @moduledoc false
    # The ops behind the Axon builders, in the form `FusedKernels.Axon.Call` runs:
    # `fused_call/2` (concrete tensors, native kernels), `nx_call/2` (pure Nx, traceable, the
    # source of the gradients) and `output_template/2`.

    @doc false
    # Options for a native call from inside a graph: `:nx` or no backend means "the best native".
    @spec native_opts(keyword) :: keyword
    def native_opts(opts) do
      backend = if opts[:backend] in [nil, :nx], do: :auto, else: opts[:backend]
      [backend: backend] ++ Keyword.take(opts, [:device])
    end

    @doc false
    @spec cast_all(term, Nx.Type.t()) :: term
    def cast_all(container, type),
      do: Nx.Defn.Composite.traverse(container, &Nx.as_type(&1, type))

    defmodule LayerNorm do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {x, gamma, beta}; LayerNorm over the last axis.
      alias FusedKernels.Axon.Ops

      @impl FusedKernels.Op
      def fused_call({x, gamma, beta}, opts) do
        type = Nx.type(x)
        {gamma, beta} = {Nx.as_type(gamma, type), Nx.as_type(beta, type)}
        FusedKernels.layer_norm(x, gamma, beta, [eps: eps(opts)] ++ Ops.native_opts(opts))
      end

      @impl FusedKernels.Op
      def nx_call({x, gamma, beta}, opts),
        do: FusedKernels.Norm.nx(:layer_norm, x, gamma, beta, eps: eps(opts))

      @impl FusedKernels.Op
      def output_template({x, _, _}, _opts), do: Nx.template(Nx.shape(x), Nx.type(x))

      defp eps(opts), do: Keyword.get(opts, :epsilon, 1.0e-5)
    end

    defmodule Dense do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {%{x:, kernel:, bias: (optional), residual: (optional)}};
      # act(x · kernel + bias) + residual.
      alias FusedKernels.Axon.Ops

      @impl FusedKernels.Op
      def fused_call({ops}, opts) do
        type = Nx.type(ops.x)
        ops = Ops.cast_all(ops, type)

        FusedKernels.Dense.dense(
          ops.x,
          ops.kernel,
          ops[:bias],
          [activation: activation(opts), residual: ops[:residual]] ++ Ops.native_opts(opts)
        )
      end

      @impl FusedKernels.Op
      def nx_call({ops}, opts),
        do: FusedKernels.Dense.nx(:dense, ops, activation: activation(opts))

      @impl FusedKernels.Op
      def output_template({%{x: x, kernel: k}}, _opts),
        do:
          Nx.template(
            x |> Nx.shape() |> put_elem(Nx.rank(x) - 1, elem(Nx.shape(k), 1)),
            Nx.type(x)
          )

      defp activation(opts), do: Keyword.get(opts, :activation, :none) || :none
    end

    defmodule Attention do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {x, params}; params by role: "q", "k", "v" (or "qkv" packed) and optionally "out",
      # each %{"kernel" => ..., "bias" => ...} as Axon.dense has them. x {batch, seq, embed}.
      alias FusedKernels.Axon.Ops

      @impl FusedKernels.Op
      def fused_call({x, params}, opts) do
        type = Nx.type(x)
        params = Ops.cast_all(params, type)
        native = Ops.native_opts(opts)

        forward(x, params, opts, %{
          dense: fn t, p -> FusedKernels.Dense.dense(t, p["kernel"], p["bias"], native) end,
          attention: fn q, k, v, o -> FusedKernels.flash_attention(q, k, v, o ++ native) end
        })
      end

      @impl FusedKernels.Op
      def nx_call({x, params}, opts) do
        forward(x, params, opts, %{
          dense: fn t, p ->
            FusedKernels.Dense.nx(:dense, %{x: t, kernel: p["kernel"], bias: p["bias"]}, [])
          end,
          attention: &FusedKernels.FlashAttention.nx/4
        })
      end

      @impl FusedKernels.Op
      def output_template({x, params}, opts) do
        {b, s, _} = Nx.shape(x)

        units =
          case params do
            %{"out" => %{"kernel" => k}} -> elem(Nx.shape(k), 1)
            _ -> opts[:heads] * head_dim(params, opts)
          end

        Nx.template({b, s, units}, Nx.type(x))
      end

      @doc false
      # The layer with `impl`'s dense and attention (the EXLA custom-call path lowers each).
      @spec forward(Nx.Tensor.t(), map, keyword, %{atom => function}) :: Nx.Tensor.t()
      def forward(x, params, opts, impl) do
        {b, s, _} = Nx.shape(x)
        heads = opts[:heads]
        kv_heads = opts[:kv_heads] || heads
        d = head_dim(params, opts)

        {q, k, v} =
          case params do
            %{"qkv" => p} ->
              qkv = impl.dense.(x, p)

              {Nx.slice_along_axis(qkv, 0, heads * d, axis: 2),
               Nx.slice_along_axis(qkv, heads * d, kv_heads * d, axis: 2),
               Nx.slice_along_axis(qkv, (heads + kv_heads) * d, kv_heads * d, axis: 2)}

            %{"q" => pq, "k" => pk, "v" => pv} ->
              {impl.dense.(x, pq), impl.dense.(x, pk), impl.dense.(x, pv)}
          end

        attn_opts = [causal: opts[:causal] || false, window: opts[:window] || {-1, -1}]
        attn_opts = if opts[:scale], do: [scale: opts[:scale]] ++ attn_opts, else: attn_opts

        y =
          impl.attention.(
            Nx.reshape(q, {b, s, heads, d}),
            Nx.reshape(k, {b, s, kv_heads, d}),
            Nx.reshape(v, {b, s, kv_heads, d}),
            attn_opts
          )
          |> Nx.reshape({b, s, heads * d})

        case params do
          %{"out" => p} -> impl.dense.(y, p)
          _ -> y
        end
      end

      # The per-head size: the q projection's width over the heads.
      defp head_dim(params, opts) do
        heads = opts[:heads]
        kv_heads = opts[:kv_heads] || heads

        case params do
          %{"qkv" => %{"kernel" => k}} -> div(elem(Nx.shape(k), 1), heads + 2 * kv_heads)
          %{"q" => %{"kernel" => k}} -> div(elem(Nx.shape(k), 1), heads)
        end
      end
    end

    defmodule MambaBlock do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {x, params}, params keyed by Edifice's layer names ("<name>_norm", ...).
      alias FusedKernels.Axon.Ops

      @keys [:name, :eps, :dt_min, :dt_max, :b_discretization, :residual]

      @impl FusedKernels.Op
      def fused_call({x, params}, opts) do
        type = Nx.type(x)
        # The native block takes f32 weights; f32 inside either way (as the pure path).
        {x32, params} = {Nx.as_type(x, {:f, 32}), Ops.cast_all(params, {:f, 32})}

        x32
        |> FusedKernels.mamba_block(params, Keyword.take(opts, @keys) ++ Ops.native_opts(opts))
        |> Nx.as_type(type)
      end

      @impl FusedKernels.Op
      def nx_call({x, params}, opts),
        do: FusedKernels.MambaBlock.nx(x, params, Keyword.take(opts, @keys))

      @impl FusedKernels.Op
      def output_template({x, _}, _opts), do: Nx.template(Nx.shape(x), Nx.type(x))
    end
  end
end
