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
  `:driver_version`, `:nvrtc_version`, `:cublas_available`, `:features` (what the kernels may
  use here: `:cp_async`, `:mma_bf16_tf32`, `:clusters`, `:pdl`, `:wgmma_tma`, ...) and
  `:paths` (`{op, kernels it launches here}` pairs), `:kernels` (`{op, kernel families its
  files define for this GPU}` pairs, from the instance tables); without one, `:reason`.
  """
  @spec info(keyword) :: map
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
  @spec set_cache_dir(String.t()) :: :ok
  def set_cache_dir(dir) when is_binary(dir),
    do: dir |> Native.set_cache_dir() |> Native.unwrap!()

  def set_cache_dir(other),
    do: raise(ArgumentError, "cache dir must be a string path, got: #{inspect(other, limit: 5)}")

  @doc """
  Compiles every kernel program the runtime may load on the given GPU architectures into a
  kernel cache directory, ahead of time and without a GPU (NVRTC only), so that first calls
  there compile nothing. Each entry is keyed like the runtime's (kernel, function, source and
  headers, options, architecture, NVRTC version): a machine with the same NVRTC major.minor
  that uses this directory as its cache reads them; a different NVRTC ignores them. Entries
  already there are kept. Prints one line per program; takes minutes for a cold directory.

  Options:
    * `archs` - list like `["sm_90", "sm_120"]`; default: the local GPU's (raises without one)
    * `cache_dir` - default: the runtime's cache directory (`info()[:cache_dir]`)
    * `route_as` - `"sm_86"`: the programs of a GPU routed as that older one, or
      `"sm_120"` on a Hopper (the `route-as-*` test builds); default `nil`
    * `jobs` - compilations at once; default: the number of schedulers

  Returns `%{compiled: n, present: n, failed: [String.t()], bytes: n}`.
  """
  @spec prefill(keyword) :: %{
          compiled: non_neg_integer,
          present: non_neg_integer,
          failed: [String.t()],
          bytes: non_neg_integer
        }
  def prefill(opts \\ []) do
    opts = Keyword.validate!(opts, [:archs, :cache_dir, :route_as, :jobs])

    archs =
      case Keyword.get(opts, :archs) do
        nil ->
          [local_arch!()]

        archs when is_list(archs) ->
          archs

        other ->
          raise ArgumentError, "archs must be a list like [\"sm_90\"], got: #{inspect(other)}"
      end

    dir = Keyword.get_lazy(opts, :cache_dir, fn -> info()[:cache_dir] end)

    if not is_binary(dir) do
      raise ArgumentError, "cache_dir must be a string path, got: #{inspect(dir, limit: 5)}"
    end

    jobs = Keyword.get(opts, :jobs, System.schedulers_online())
    route_as = Keyword.get(opts, :route_as)

    archs
    |> Native.kernel_prefill(route_as, dir, jobs)
    |> Native.unwrap!()
  end

  @warmup_ops ~w(lstm gru dense flash_attention scaled_softmax selective_scan layer_norm rms_norm mamba_block)a

  @doc """
  Compiles (or reads from the kernel cache) and loads ahead of time the GPU kernels that
  first calls would otherwise compile, printing one line per kernel:

    * a list of ops (#{inspect(@warmup_ops)}): every kernel program those ops may launch on
      this GPU (each path their router may pick here, every type), several at once;
    * a `FusedKernels.Backbone` handle on `:cuda`: exactly what its windows and frames launch
      (one zero window and one frame are run through the engine; the handle's states are not
      touched). Other backends have nothing to compile.

  On a cold cache a first call loads a quick build of the slowest programs and swaps in the
  full build when its background compile is done; `warmup` returns once every full build is
  loaded.

  Options: `device`. Returns `:ok`; raises `FusedKernels.Error` when a kernel does not compile
  or there is no GPU.
  """
  @spec warmup([atom] | struct, keyword) :: :ok
  def warmup(ops_or_backbone, opts \\ [])

  def warmup(ops, opts) when is_list(ops) do
    Enum.each(ops, fn op ->
      if op not in @warmup_ops do
        raise ArgumentError,
              "warmup: unknown op #{inspect(op)}; known: #{inspect(@warmup_ops)}"
      end
    end)

    device = FusedKernels.Backend.device(opts)

    ops
    |> Enum.map(&Atom.to_string/1)
    |> Native.kernel_warmup(device)
    |> Native.unwrap!()

    :ok
  end

  def warmup(%{__struct__: FusedKernels.Backbone, backend: :cuda, spec: spec} = handle, _opts) do
    window =
      {:binary.copy(<<0.0::float-32-native>>, spec.window * spec.embed),
       {1, spec.window, spec.embed}, {:f, 32}}

    frame = {:binary.copy(<<0.0::float-32-native>>, spec.embed), {1, spec.embed}, {:f, 32}}
    _ = FusedKernels.Backbone.predict(handle, window)
    state = FusedKernels.Backbone.init_state(handle, 1)
    _ = FusedKernels.Backbone.step(handle, state, frame)
    # On a cold cache the slowest programs ran on quick builds: wait for their full builds.
    [] |> Native.kernel_warmup(handle.device) |> Native.unwrap!()
    :ok
  end

  def warmup(%{__struct__: FusedKernels.Backbone}, _opts), do: :ok

  def warmup(other, _opts),
    do:
      raise(
        ArgumentError,
        "warmup takes a list of ops or a FusedKernels.Backbone handle, got: #{inspect(other, limit: 5)}"
      )

  @doc "`\"sm_XY\"` of the local GPU (or `device:`), or `nil` without one."
  @spec local_arch(keyword) :: String.t() | nil
  def local_arch(opts \\ []) do
    case info(opts) do
      %{cuda_available: true, compute_capability: {major, minor}} -> "sm_#{major}#{minor}"
      _ -> nil
    end
  end

  defp local_arch! do
    local_arch() ||
      raise ArgumentError,
            "no GPU here (#{info()[:reason]}): give the architectures, e.g. archs: [\"sm_90\"]"
  end

  if Code.ensure_loaded?(Nx) do
    @doc """
    `softmax(scale * x)` over the last axis of a `{rows, cols}` or
    `{batch, heads, seq_q, seq_k}` tensor: one read and one write per element.

    Options: `scale` (1.0), `causal` (false; aligned bottom-right when seq_q != seq_k, masked
    entries and fully masked rows are 0), `backend`, `device`, `out: :host | :device`.
    """
    @spec scaled_softmax(FusedKernels.Tensor.t(), keyword) :: FusedKernels.Tensor.nx()
    defdelegate scaled_softmax(x, opts \\ []), to: FusedKernels.ScaledSoftmax, as: :run

    @doc """
    `activation(x · kernel + bias) + residual` in one kernel (the epilogue is fused into the
    GEMM: one write of the output). x `{..., in}` (leading dims flattened), kernel
    `{in, units}`, bias `{units}`, residual the output's shape.

    Options: `activation` (`:none`, `:relu`, `:gelu`, `:gelu_tanh`, `:silu`, `:sigmoid`,
    `:tanh`), `residual`, `backend`, `device`, `out: :host | :device`. `dense(x, kernel, opts)`
    works too, and so does a kernel (with its bias) prepared once by
    `FusedKernels.Dense.prepare/3` in the kernel's place.
    """
    @spec dense(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t() | FusedKernels.Dense.Prepared.t(),
            FusedKernels.Tensor.t() | nil | keyword,
            keyword
          ) :: FusedKernels.Tensor.nx()
    defdelegate dense(x, kernel, bias \\ nil, opts \\ []), to: FusedKernels.Dense

    @doc """
    SwiGLU: `silu(x · w_gate + bias_gate) * (x · w_up + bias_up)` in one kernel; both products
    share every read of x. Options: `bias_gate`, `bias_up`, `backend`, `device`, `out`.
    """
    @spec swiglu(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx()
    defdelegate swiglu(x, w_gate, w_up, opts \\ []), to: FusedKernels.Dense

    @doc """
    `dense(rms_norm(x) * norm_weight, kernel)`: the RMSNorm over x's last axis is applied
    while the GEMM loads x, so the normalised activations never go to memory. Options: `eps`
    (1.0e-6), `bias`, `activation`, `residual`, `backend`, `device`, `out`.
    """
    @spec rms_norm_dense(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx()
    defdelegate rms_norm_dense(x, norm_weight, kernel, opts \\ []), to: FusedKernels.Dense

    @doc """
    `dense(layer_norm(x) * gamma + beta, kernel)`, the LayerNorm applied while the GEMM loads
    x. Options: `eps` (1.0e-5), `bias`, `activation`, `residual`, `backend`, `device`, `out`.
    """
    @spec layer_norm_dense(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx()
    defdelegate layer_norm_dense(x, gamma, beta, kernel, opts \\ []), to: FusedKernels.Dense

    @doc """
    Attention, `softmax(scale * q k^T + mask) v`, with FlashAttention's conventions.

    q is `{batch, seq_q, heads, head_dim}` and k, v `{batch, seq_k, kv_heads, head_dim}`
    (`layout: :bhsd` takes `{batch, heads, seq, head_dim}`); heads must be a multiple of
    kv_heads (GQA/MQA); head_dim up to 256; f32, f16 or bf16 (output in q's type, f32
    accumulation). Options: `causal` (false; aligned bottom-right when seq_q != seq_k),
    `scale` (1/sqrt(head_dim)), `window: {left, right}` (-1 unbounded), `return_lse`
    (false; true returns `{out, lse}` with lse `{batch, heads, seq_q}` f32), `layout`,
    `backend`, `device`, `out: :host | :device`. A query row that sees no key gives zeros
    (and lse +inf, as in FlashAttention).
    """
    @spec flash_attention(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    defdelegate flash_attention(q, k, v, opts \\ []), to: FusedKernels.FlashAttention, as: :run

    @doc """
    `Axon.lstm` with the given params (Axon's map) on `x` `{batch, seq, features}`:
    `{sequence, {c, h}}`. Options: `initial_state` (`{c, h}`, zeros by default; Axon's own
    from `FusedKernels.Axon.initial_state/4`; see below),
    `reverse` (false; true processes the sequence last to first, each output at its own
    position), `backend`,
    `device`, `out`, `precision` (`:f32`, the default, keeps f32 calls f32-accurate; `:tf32`
    lets the CUDA large-batch path use single-pass TF32 products, ~1e-3 relative error, as
    PyTorch's cuDNN does by default). f32/f16/bf16 (f32 accumulation and cell state).

    The initial state differs from a default `Axon.lstm` model's: Axon draws its initial
    `{c, h}` at random (`recurrent_initializer: :glorot_uniform`, from a key in the model's
    params), ours is zeros, so outputs differ (by up to ~0.3 on random weights) unless the
    states agree. For the same numbers build the Axon model with
    `recurrent_initializer: :zeros`, or pass Axon's state here as `initial_state: {c, h}`.

    `params` may also be prepared once by `FusedKernels.Rnn.prepare/3` (weights packed for the
    CPU kernels once instead of on every call; the same results).
    """
    @spec lstm(FusedKernels.Tensor.t(), map | FusedKernels.Rnn.Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx(), tuple}
    def lstm(x, params, opts \\ []),
      do: FusedKernels.Rnn.run_one(:lstm, x, params, opts)

    @doc "`Axon.gru` with the given params: `{sequence, {h}}`; options as `lstm/3`."
    @spec gru(FusedKernels.Tensor.t(), map | FusedKernels.Rnn.Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx(), tuple}
    def gru(x, params, opts \\ []),
      do: FusedKernels.Rnn.run_one(:gru, x, params, opts)

    @doc """
    Several LSTM layers in one call (a list of param maps), layer l+1 consuming layer l's
    sequence on the device: `{sequence, [{c, h} per layer]}`; `initial_state` is a list.
    `params_list` may be prepared once by `FusedKernels.Rnn.prepare/3`.
    """
    @spec lstm_stack(FusedKernels.Tensor.t(), [map] | FusedKernels.Rnn.Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx(), [tuple]}
    def lstm_stack(x, params_list, opts \\ []),
      do: FusedKernels.Rnn.run_many(:lstm, x, params_list, opts)

    @doc "Several GRU layers in one call: `{sequence, [{h} per layer]}`."
    @spec gru_stack(FusedKernels.Tensor.t(), [map] | FusedKernels.Rnn.Prepared.t(), keyword) ::
            {FusedKernels.Tensor.nx(), [tuple]}
    def gru_stack(x, params_list, opts \\ []),
      do: FusedKernels.Rnn.run_many(:gru, x, params_list, opts)

    @doc """
    Selective scan with mamba_ssm's semantics: u, delta `{batch, seq, channels}`; a
    `{channels, state}` (state <= 256); b, c `{batch, seq, state}` or `{batch, seq, groups, state}`.
    Options: `d`, `z` (output * silu(z)), `delta_bias`, `delta_softplus` (false),
    `initial_state` / `return_last_state` (`{batch, channels, state}` f32),
    `b_discretization` (`:per_channel` | `:mean_dt`), `backend`, `device`, `out`.
    Returns the output, or `{output, last_state}`.
    """
    @spec selective_scan(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
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
    @spec mamba_block(FusedKernels.Tensor.t(), map | struct, keyword) :: FusedKernels.Tensor.nx()
    defdelegate mamba_block(x, params, opts \\ []), to: FusedKernels.MambaBlock, as: :run

    @doc "LayerNorm over the last axis (`eps`, `residual: r` -> `{normed, x + r}`)."
    @spec layer_norm(
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t(),
            FusedKernels.Tensor.t() | nil,
            keyword
          ) :: FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    def layer_norm(x, gamma, beta, opts \\ []),
      do: FusedKernels.Norm.run(:layer_norm, x, gamma, beta, opts)

    @doc "RMSNorm over the last axis (`eps`, `residual: r` -> `{normed, x + r}`)."
    @spec rms_norm(FusedKernels.Tensor.t(), FusedKernels.Tensor.t(), keyword) ::
            FusedKernels.Tensor.nx() | {FusedKernels.Tensor.nx(), FusedKernels.Tensor.nx()}
    def rms_norm(x, weight, opts \\ []),
      do: FusedKernels.Norm.run(:rms_norm, x, weight, nil, opts)
  end
end
