defmodule FusedKernels.ScaledSoftmax do
  @moduledoc """
  `softmax(scale * x)` over the last axis, optionally causal. Native side:
  `native/fused_kernels_core/src/ops/scaled_softmax.rs` and `kernels/scaled_softmax.cu`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts, scale: {1.0, :number}, causal: {false, :boolean})
  end

  @doc """
  Runs on a native backend with no Nx involved: `x` is a `{binary, shape, type}` triple or a
  `FusedKernels.Buffer`; returns a triple (or a buffer with `out: :device`).
  """
  @spec native(FusedKernels.Tensor.t(), keyword) :: FusedKernels.Tensor.result()
  def native(x, opts \\ []) do
    opts = options(opts)
    backend = Backend.select_native(opts)
    call(Tensor.to_native(x), backend, opts)
  end

  defp call(x, backend, opts) do
    %{x: x}
    |> Native.scaled_softmax(%{
      scale: opts[:scale] * 1.0,
      causal: opts[:causal],
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> Buffer.wrap()
  end

  if Code.ensure_loaded?(Nx) do
    @doc "See `FusedKernels.scaled_softmax/2`."
    @spec run(FusedKernels.Tensor.t(), keyword) ::
            FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
    def run(%Buffer{} = x, opts), do: native(x, opts)

    def run(x, opts) do
      opts = options(opts)
      x = Nx.to_tensor(x)

      unless Nx.rank(x) in [2, 4] do
        raise ArgumentError,
              "x: scaled_softmax takes a 2-D {rows, cols} or 4-D {batch, heads, seq_q, seq_k} " <>
                "tensor, got shape #{inspect(Nx.shape(x))}"
      end

      Tensor.check!("x", x)

      case Backend.select(opts, Tensor.symbolic?(x)) do
        :nx ->
          nx(x, opts)

        backend ->
          result = call(Tensor.to_native(x), backend, opts)
          if opts[:out] == :device, do: result, else: Tensor.to_nx(result)
      end
    end

    # The op interface of FusedKernels.Axon.Call (fused layers inside graphs).
    @behaviour FusedKernels.Op

    @impl FusedKernels.Op
    def fused_call({x}, opts), do: run(x, Keyword.put(opts, :backend, native_backend(opts)))
    @impl FusedKernels.Op
    def nx_call({x}, opts), do: nx(x, opts)
    @impl FusedKernels.Op
    def output_template({x}, _opts), do: Nx.template(Nx.shape(x), Nx.type(x))

    defp native_backend(opts) do
      case Keyword.get(opts, :backend, :auto) do
        :nx -> :auto
        b -> b
      end
    end

    @doc """
    The pure-Nx implementation (f32 arithmetic, output in the input type); works on any Nx
    backend and inside `defn`.
    """
    @spec nx(FusedKernels.Tensor.nx(), keyword) :: FusedKernels.Tensor.nx()
    def nx(x, opts \\ []) do
      scale = Keyword.get(opts, :scale, 1.0)
      causal = Keyword.get(opts, :causal, false)
      type = Nx.type(x)
      rank = Nx.rank(x)

      unless rank in [2, 4] do
        raise ArgumentError,
              "x: scaled_softmax takes a 2-D {rows, cols} or 4-D {batch, heads, seq_q, seq_k} tensor, got shape #{inspect(Nx.shape(x))}"
      end

      compute = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
      s = x |> Nx.as_type(compute) |> Nx.multiply(scale)
      {sq, sk} = {elem(Nx.shape(x), rank - 2), elem(Nx.shape(x), rank - 1)}

      mask =
        if causal do
          # Bottom-right aligned: query row q keeps keys j <= q + sk - sq.
          Nx.greater_equal(
            Nx.add(Nx.iota({sq, sk}, axis: 0), sk - sq),
            Nx.iota({sq, sk}, axis: 1)
          )
          |> Nx.broadcast(Nx.shape(x))
        else
          Nx.broadcast(Nx.tensor(1, type: {:u, 8}), Nx.shape(x))
        end

      neg_inf = Nx.Constants.neg_infinity(compute)
      masked = Nx.select(mask, s, neg_inf)
      m = Nx.reduce_max(masked, axes: [-1], keep_axes: true)
      # A fully masked row has max -inf; use 0 so exp stays finite, and its sum is 0.
      m = Nx.select(Nx.equal(m, neg_inf), Nx.tensor(0, type: compute), m)
      e = Nx.select(mask, Nx.exp(Nx.subtract(s, m)), Nx.tensor(0, type: compute))
      z = Nx.sum(e, axes: [-1], keep_axes: true)
      safe_z = Nx.select(Nx.equal(z, 0), Nx.tensor(1, type: compute), z)

      e
      |> Nx.divide(safe_z)
      |> Nx.as_type(type)
    end
  end
end
