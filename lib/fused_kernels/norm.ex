defmodule FusedKernels.Norm do
  @moduledoc """
  LayerNorm and RMSNorm over the last axis with an optional fused residual add
  (`residual: r` returns `{normed, x + r}`). Native side: `ops/norm/`, `kernels/norm.cu`; pure
  Nx: `FusedKernels.Nx.Norm`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts, eps: {1.0e-5, :non_negative}, residual: {nil, :any})
  end

  @doc "Natively, with triples or buffers: `kind` is `:layer_norm` or `:rms_norm`."
  @spec native(
          :layer_norm | :rms_norm,
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t() | nil,
          keyword
        ) ::
          FusedKernels.Tensor.result()
          | {FusedKernels.Tensor.result(), FusedKernels.Tensor.result()}
  def native(kind, x, weight, bias, opts \\ []) do
    opts = options(opts)
    call(kind, [x, weight, bias], Backend.select_native(opts), opts, & &1)
  end

  defp call(kind, [x, weight, bias], backend, opts, finish) do
    nat = fn
      nil -> nil
      t -> Tensor.to_native(t)
    end

    %{x: nat.(x), weight: nat.(weight), beta: nat.(bias), residual: nat.(opts[:residual])}
    |> Native.norm(%{
      kind: kind,
      eps: opts[:eps] * 1.0,
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> case do
      {y, s} -> {finish.(Buffer.wrap(y)), finish.(Buffer.wrap(s))}
      y -> finish.(Buffer.wrap(y))
    end
  end

  if Code.ensure_loaded?(Nx) do
    @doc false
    @spec run(
            :layer_norm | :rms_norm,
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t() | nil,
            keyword
          ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result() | tuple
    def run(kind, x, weight, bias, opts) do
      opts = options(opts)

      if match?(%Buffer{}, x) do
        native(kind, x, weight, bias, opts)
      else
        tensors =
          Enum.map([x, weight, bias], fn
            nil -> nil
            t -> Nx.to_tensor(t)
          end)

        check_inputs!(kind, tensors, opts[:residual])
        symbolic? = Enum.any?(tensors ++ [opts[:residual]], &Tensor.symbolic?/1)

        case Backend.select(opts, symbolic?) do
          :nx ->
            # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
            with :skip <- FusedKernels.XLA.Ops.norm(kind, tensors, opts),
                 do: apply(__MODULE__, :nx, [kind | tensors] ++ [opts])

          backend ->
            finish = if opts[:out] == :device, do: & &1, else: &Tensor.to_nx/1
            call(kind, tensors, backend, opts, finish)
        end
      end
    end

    defp check_inputs!(kind, [x, weight, bias], residual) do
      Tensor.check!("x", x, rank: Enum.to_list(1..8))
      cols = elem(Nx.shape(x), Nx.rank(x) - 1)
      Tensor.check!(if(kind == :layer_norm, do: "gamma", else: "weight"), weight, shape: {cols})

      if kind == :rms_norm and bias != nil do
        raise ArgumentError,
              "beta: rms_norm takes no bias (RMSNorm only scales by weight); drop beta, or " <>
                "use kind :layer_norm"
      end

      Tensor.check!("beta", bias, shape: {cols})

      if is_struct(residual, Nx.Tensor),
        do: Tensor.check!("residual", residual, shape: Nx.shape(x))

      :ok
    end

    @doc "The pure-Nx implementation: `FusedKernels.Nx.Norm`."
    @spec nx(
            :layer_norm | :rms_norm,
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx() | nil,
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    defdelegate nx(kind, x, weight, bias, opts \\ []), to: FusedKernels.Nx.Norm
  end
end
