defmodule FusedKernels do
  @moduledoc """
  Fused CUDA kernels (and native CPU and pure-Nx equivalents) for Nx and Axon models.

  Every op takes Nx tensors (or `FusedKernels.Buffer`s already on a GPU) and a `backend:`
  option, resolved by `FusedKernels.Backend`: `:auto` (default), `:cuda`, `:cpu` or `:nx`.
  """

  alias FusedKernels.Native

  @doc """
  What the native layer found on this machine.

  Always has `:nif_loaded`, `:cuda_available` and `:cache_dir`; with a GPU also
  `:device_name`, `:compute_capability`, `:memory_total`, `:memory_free`, `:multiprocessors`,
  `:driver_version`, `:nvrtc_version`, `:cublas_available`; without one, `:reason`.
  """
  def info(opts \\ []) do
    case Native.status() do
      :ok ->
        opts
        |> FusedKernels.Backend.device()
        |> Native.info()
        |> Map.put(:nif_loaded, true)

      {:error, reason} ->
        %{
          nif_loaded: false,
          cuda_available: false,
          reason: "the native library did not load: #{reason}",
          cache_dir: nil
        }
    end
  end

  @doc "Sets the directory for compiled kernels (also `config :fused_kernels, cache_dir:`)."
  def set_cache_dir(dir) when is_binary(dir),
    do: dir |> Native.set_cache_dir() |> Native.unwrap!()

  if Code.ensure_loaded?(Nx) do
    @doc """
    `softmax(scale * x)` over the last axis of a `{rows, cols}` or
    `{batch, heads, seq_q, seq_k}` tensor: one read and one write per element.

    Options: `scale` (1.0), `causal` (false; aligned bottom-right when seq_q != seq_k, masked
    entries and fully masked rows are 0), `backend`, `device`, `out: :host | :device`.
    """
    defdelegate scaled_softmax(x, opts \\ []), to: FusedKernels.ScaledSoftmax, as: :run

    @doc """
    Selective scan with mamba_ssm's semantics: u, delta `{batch, seq, channels}`; a
    `{channels, state}` (state <= 256); b, c `{batch, seq, state}` or `{batch, seq, groups, state}`.
    Options: `d`, `z` (output * silu(z)), `delta_bias`, `delta_softplus` (false),
    `initial_state` / `return_last_state` (`{batch, channels, state}` f32),
    `b_discretization` (`:per_channel` | `:mean_dt`), `backend`, `device`, `out`.
    Returns the output, or `{output, last_state}`.
    """
    defdelegate selective_scan(u, delta, a, b, c, opts \\ []),
      to: FusedKernels.SelectiveScan,
      as: :run

    @doc """
    One Edifice Mamba block, fused: LayerNorm -> in_proj -> causal depthwise conv + SiLU ->
    B/C and dt projections (softplus, clip [dt_min, dt_max]) -> scan -> * SiLU(z) -> out_proj
    -> + residual. `params` by Edifice's layer names for block `name:` ("mamba_block").
    Options: `name`, `eps` (1e-5), `dt_min`/`dt_max` (0.001/0.1), `b_discretization`
    (`:per_channel` default, or `:mean_dt` for Edifice's pure-Nx checkpoints), `residual`
    (true), `backend`, `device`, `out`.
    """
    defdelegate mamba_block(x, params, opts \\ []), to: FusedKernels.MambaBlock, as: :run

    @doc "LayerNorm over the last axis (`eps`, `residual: r` -> `{normed, x + r}`)."
    def layer_norm(x, gamma, beta, opts \\ []),
      do: FusedKernels.Norm.run(:layer_norm, x, gamma, beta, opts)

    @doc "RMSNorm over the last axis (`eps`, `residual: r` -> `{normed, x + r}`)."
    def rms_norm(x, weight, opts \\ []),
      do: FusedKernels.Norm.run(:rms_norm, x, weight, nil, opts)
  end
end
