defmodule FusedKernels.MambaBlock do
  @moduledoc """
  One whole Mamba block as Edifice builds it, fused (see `FusedKernels.mamba_block/3`).
  Native side: `ops/mamba_block/`, `kernels/mamba_block.cu` and the selective scan; pure Nx:
  `FusedKernels.Nx.MambaBlock`.
  """

  alias FusedKernels.{Backend, Buffer, Native, Options, Tensor}

  # {layer suffix, parameter, required?}: the order of weights/2's list (nx_with_state/4
  # matches on it), and @native_names are the NIF's keys for the same 16 weights.
  @layout [
    {"norm", "gamma", true},
    {"norm", "beta", true},
    {"in_proj", "kernel", true},
    {"in_proj", "bias", false},
    {"conv_dw_conv", "kernel", true},
    {"conv_dw_conv", "bias", false},
    {"ssm_bc_proj", "kernel", true},
    {"ssm_bc_proj", "bias", false},
    {"ssm_dt_rank", "kernel", true},
    {"ssm_dt_rank", "bias", false},
    {"ssm_dt_proj", "kernel", true},
    {"ssm_dt_proj", "bias", false},
    {"ssm", "a", false},
    {"ssm", "d", false},
    {"out_proj", "kernel", true},
    {"out_proj", "bias", false}
  ]
  @native_names ~w(norm_gamma norm_beta in_kernel in_bias conv_kernel conv_bias bc_kernel
                   bc_bias dt_rank_kernel dt_rank_bias dt_proj_kernel dt_proj_bias a d
                   out_kernel out_bias)a

  @doc false
  @spec options(term) :: keyword
  def options(opts) do
    Options.validate!(opts,
      name: {"mamba_block", {"a string such as \"mamba_block_1\"", &is_binary/1}},
      eps: {1.0e-5, :non_negative},
      dt_min: {0.001, :number},
      dt_max: {0.1, :number},
      b_discretization: {:per_channel, {:in, [:per_channel, :mean_dt]}},
      residual: {true, :boolean}
    )
  end

  @doc """
  The block's 16 parameters in a fixed order (nil where absent), looked up by Edifice's
  layer names (`"\#{name}_in_proj" => %{"kernel" => ..., "bias" => ...}` and so on). Accepts a
  plain map or a struct with a `:data` map (Axon's ModelState).
  """
  @spec weights(map | struct, String.t()) :: [term]
  def weights(params, name) do
    params = if is_struct(params) and Map.has_key?(params, :data), do: params.data, else: params

    unless is_map(params),
      do: raise(ArgumentError, "params must be a map of layer name => parameters")

    for {layer, key, required} <- @layout do
      case params |> Map.get("#{name}_#{layer}", %{}) |> Map.get(key) do
        nil when required ->
          raise ArgumentError,
                "params: missing #{inspect("#{name}_#{layer}")} => #{inspect(key)} (block name #{inspect(name)}; pass name: to match your model)"

        value ->
          value
      end
    end
  end

  @doc "Natively, with weights as triples or buffers (f32 buffers; no Nx needed)."
  @spec native(FusedKernels.Tensor.t(), map | struct, keyword) :: FusedKernels.Tensor.result()
  def native(x, params, opts \\ []) do
    opts = options(opts)
    call(x, weights(params, opts[:name]), Backend.select_native(opts), opts)
  end

  @doc """
  One chunk of a stream (e.g. one frame `{batch, 1, hidden}`) from a carried state, natively:
  `conv_state` `{batch, k - 1, inner}` and `ssm_state` `{batch, inner, state}` (f32; zeros at
  the start). Returns `{out, conv_state, ssm_state}`, buffers with `out: :device`.
  """
  @spec native_state(
          FusedKernels.Tensor.t(),
          map | struct,
          FusedKernels.Tensor.t(),
          FusedKernels.Tensor.t(),
          keyword
        ) ::
          {FusedKernels.Tensor.result(), FusedKernels.Tensor.result(),
           FusedKernels.Tensor.result()}
  def native_state(x, params, conv_state, ssm_state, opts \\ []) do
    opts = options(opts)

    nat = fn
      nil -> nil
      t -> Tensor.to_native(t)
    end

    {y, c, s} =
      %{
        x: nat.(x),
        weights: native_weights(weights(params, opts[:name])),
        conv_state: nat.(conv_state),
        ssm_state: nat.(ssm_state)
      }
      |> Native.mamba_block_state(native_options(Backend.select_native(opts), opts))
      |> Native.unwrap!()

    {Buffer.wrap(y), Buffer.wrap(c), Buffer.wrap(s)}
  end

  defp call(x, weights, backend, opts) do
    %{x: Tensor.to_native(x), weights: native_weights(weights)}
    |> Native.mamba_block(native_options(backend, opts))
    |> Native.unwrap!()
    |> Buffer.wrap()
  end

  defp native_weights(weights) do
    @native_names
    |> Enum.zip(weights)
    |> Map.new(fn
      {name, nil} -> {name, nil}
      {name, t} -> {name, Tensor.to_native(t)}
    end)
  end

  defp native_options(backend, opts) do
    %{
      eps: opts[:eps] * 1.0,
      dt_min: opts[:dt_min] * 1.0,
      dt_max: opts[:dt_max] * 1.0,
      b_discretization: opts[:b_discretization],
      residual: opts[:residual],
      backend: backend,
      device: Backend.device(opts),
      out: opts[:out]
    }
  end

  if Code.ensure_loaded?(Nx) do
    @doc "See `FusedKernels.mamba_block/3`."
    @spec run(FusedKernels.Tensor.t(), map | struct, keyword) ::
            FusedKernels.Tensor.nx() | FusedKernels.Tensor.result()
    def run(%Buffer{} = x, params, opts), do: native(x, params, opts)

    def run(x, params, opts) do
      opts = options(opts)
      x = Nx.to_tensor(x)
      Tensor.check!("x", x, rank: 3)
      w = weights(params, opts[:name])
      for t <- w, is_struct(t, Nx.Tensor), do: Tensor.check!("params", t)

      case Backend.select(opts, Enum.any?([x | w], &Tensor.symbolic?/1)) do
        :nx ->
          # Inside defn: an XLA custom call where EXLA serves it (FusedKernels.XLA).
          with :skip <- FusedKernels.XLA.Ops.mamba_block(x, params, opts),
               do: nx(x, params, opts)

        backend ->
          result = call(x, w, backend, opts)
          if opts[:out] == :device, do: result, else: Tensor.to_nx(result)
      end
    end

    @doc "The pure-Nx implementation: `FusedKernels.Nx.MambaBlock`."
    @spec nx(FusedKernels.Tensor.nx(), map | struct, keyword) :: FusedKernels.Tensor.nx()
    def nx(x, params, opts \\ []) do
      {out, nil} = nx_with_state(x, params, nil, opts)
      out
    end

    @doc """
    `nx/3` continuing from a carried state `{conv_state, ssm_state}` (`{batch, k - 1, inner}`
    earlier conv inputs, `{batch, inner, state}`), for streaming: returns `{out, next_state}`.
    With `nil` the conv sees zero padding and the scan starts from zeros (`{out, nil}`).
    """
    @spec nx_with_state(FusedKernels.Tensor.nx(), map | struct, tuple | nil, keyword) ::
            {FusedKernels.Tensor.nx(), tuple | nil}
    def nx_with_state(x, params, state, opts \\ []) do
      weights = weights(params, Keyword.get(opts, :name, "mamba_block"))
      FusedKernels.Nx.MambaBlock.nx_with_state(x, weights, state, opts)
    end
  end
end
