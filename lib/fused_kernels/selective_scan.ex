defmodule FusedKernels.SelectiveScan do
  @moduledoc """
  Selective scan with mamba_ssm's semantics. Native side:
  `native/fused_kernels_core/src/ops/selective_scan/` and `kernels/selective_scan.cu`; pure Nx:
  `FusedKernels.Nx.SelectiveScan`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts,
      d: {nil, :any},
      z: {nil, :any},
      delta_bias: {nil, :any},
      delta_softplus: {false, :boolean},
      initial_state: {nil, :any},
      return_last_state: {false, :boolean},
      b_discretization: {:per_channel, {:in, [:per_channel, :mean_dt]}}
    )
  end

  @doc """
  Runs natively with triples or `FusedKernels.Buffer`s (no Nx needed). Returns the output, or
  `{output, last_state}` with `return_last_state: true`.
  """
  @spec native(
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          keyword
        ) ::
          FusedKernels.Tensor.result()
          | {FusedKernels.Tensor.result(), FusedKernels.Tensor.result()}
  def native(u, delta, a, b, c, opts \\ []) do
    opts = options(opts)
    call([u, delta, a, b, c], Backend.select_native(opts), opts, & &1)
  end

  defp call(tensors, backend, opts, finish) do
    [u, delta, a, b, c] = Enum.map(tensors, &Tensor.to_native/1)
    opt = fn key -> if t = opts[key], do: Tensor.to_native(t), else: nil end

    %{
      u: u,
      delta: delta,
      a: a,
      b: b,
      c: c,
      d: opt.(:d),
      z: opt.(:z),
      delta_bias: opt.(:delta_bias),
      initial_state: opt.(:initial_state)
    }
    |> Native.selective_scan(%{
      delta_softplus: opts[:delta_softplus],
      b_discretization: opts[:b_discretization],
      return_last_state: opts[:return_last_state],
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    })
    |> Native.unwrap!()
    |> case do
      {y, last} when not is_binary(y) -> {finish.(Buffer.wrap(y)), finish.(Buffer.wrap(last))}
      y -> finish.(Buffer.wrap(y))
    end
  end

  if Code.ensure_loaded?(Nx) do
    @doc "See `FusedKernels.selective_scan/6`."
    @spec run(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx() | FusedKernels.Tensor.result() | tuple
    def run(u, delta, a, b, c, opts \\ []) do
      opts = options(opts)
      tensors = [u, delta, a, b, c]

      if Enum.all?(tensors, &match?(%Buffer{}, &1)) do
        native(u, delta, a, b, c, opts)
      else
        tensors = Enum.map(tensors, &to_tensor/1)
        optional = Enum.map([:d, :z, :delta_bias, :initial_state], &opts[&1])
        check_inputs!(tensors, opts)
        symbolic? = Enum.any?(tensors ++ optional, &Tensor.symbolic?/1)

        case Backend.select(opts, symbolic?) do
          :nx ->
            # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
            with :skip <- FusedKernels.XLA.Ops.selective_scan(tensors, opts),
                 do: apply(&nx/6, tensors ++ [opts])

          backend ->
            finish = if opts[:out] == :device, do: & &1, else: &Tensor.to_nx/1
            call(tensors, backend, opts, finish)
        end
      end
    end

    # mamba_ssm's shapes (the native geometry's rules), checked before any backend runs.
    defp check_inputs!([u, delta, a, b, c], opts) do
      if Enum.all?([u, delta, a, b, c], &is_struct(&1, Nx.Tensor)) do
        Tensor.check!("u", u, rank: 3)
        {nb, nl, nd} = Nx.shape(u)
        Tensor.check!("delta", delta, shape: {nb, nl, nd})
        Tensor.check!("a", a, shape: {nd, :_})
        n = elem(Nx.shape(a), 1)
        bc_shape = if Nx.rank(b) == 4, do: {nb, nl, :_, n}, else: {nb, nl, n}
        Tensor.check!("b", b, shape: bc_shape)
        Tensor.check!("c", c, shape: bc_shape)

        for {key, shape} <- [
              d: {nd},
              z: {nb, nl, nd},
              delta_bias: {nd},
              initial_state: {nb, nd, n}
            ],
            t = opts[key],
            is_struct(t, Nx.Tensor),
            do: Tensor.check!(Atom.to_string(key), t, shape: shape)
      end

      :ok
    end

    defp to_tensor(%Buffer{} = b), do: b
    defp to_tensor(t), do: Nx.to_tensor(t)

    @doc "The pure-Nx implementation: `FusedKernels.Nx.SelectiveScan`."
    @spec nx(
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            FusedKernels.Tensor.nx(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    defdelegate nx(u, delta, a, b, c, opts \\ []), to: FusedKernels.Nx.SelectiveScan
  end
end
