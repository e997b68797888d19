defmodule FusedKernels.ScaledSoftmax do
  @moduledoc """
  `softmax(scale * x)` over the last axis, optionally causal. Native side:
  `native/fused_kernels_core/src/ops/scaled_softmax/` and `kernels/scaled_softmax.cu`; pure Nx:
  `FusedKernels.Nx.ScaledSoftmax`.
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

    @doc "The pure-Nx implementation: `FusedKernels.Nx.ScaledSoftmax`."
    @spec nx(FusedKernels.Tensor.nx(), keyword) :: FusedKernels.Tensor.nx()
    defdelegate nx(x, opts \\ []), to: FusedKernels.Nx.ScaledSoftmax
  end
end
