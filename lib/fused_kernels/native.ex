defmodule FusedKernels.Native do
  @moduledoc """
  The NIF, loaded when this module loads. Needs no Nx.

  Tensors cross as `{binary, shape_tuple, type}` triples (Nx's type tuples) or as device
  buffer references. An op takes two maps, its tensors and its options, e.g.
  `scaled_softmax(%{x: x}, %{scale: 1.0, causal: false, backend: :cpu, device: nil, out:
  :host})`; a missing, misspelt or ill-typed key is an `:argument` error naming it (optional
  tensors and `device` may be left out). The prepared-weights and backbone engine NIFs take
  the same two maps, their resources among the inputs (`engine_step(%{engine: e, state: s,
  frame: f}, %{})`). Every function returns `{:ok, value}` or
  `{:error, {kind, message}}` with kind `:argument`, `:unavailable`, `:out_of_memory`,
  `:compile`, `:cuda` or `:nif_not_loaded`; `unwrap!/1` raises `ArgumentError` for
  `:argument` and `FusedKernels.Error` for the rest.

  If the library cannot be loaded (missing file, wrong architecture), the module still loads,
  `status/0` says why, and every NIF returns `{:error, {:nif_not_loaded, reason}}`.
  """

  @typedoc "A NIF's answer: `{:ok, value}` or `{:error, {kind, message}}`."
  @type reply :: {:ok, term} | {:error, {atom, String.t()}}

  @on_load :load_nif
  @status_key {__MODULE__, :status}
  @stub_key {__MODULE__, :stub_reply}

  @doc false
  @spec load_nif() :: :ok
  def load_nif do
    status =
      case nif_path() do
        {:ok, path} ->
          case :erlang.load_nif(String.to_charlist(path), 0) do
            :ok -> :ok
            {:error, {reason, text}} -> {:error, "#{reason}: #{text}"}
          end

        {:error, reason} ->
          {:error, reason}
      end

    :persistent_term.put(@status_key, status)

    reason =
      case status do
        {:error, r} -> r
        :ok -> "NIF stub called although the library loaded"
      end

    :persistent_term.put(@stub_key, {:error, {:nif_not_loaded, reason}})
    # Always :ok, so the application starts and the pure-Nx backend can serve.
    :ok
  end

  defp nif_path do
    case System.get_env("FUSED_KERNELS_NIF_PATH") do
      path when is_binary(path) and path != "" ->
        {:ok, Path.rootname(path, ".so")}

      _ ->
        case :code.priv_dir(:fused_kernels) do
          {:error, reason} -> {:error, "priv dir of :fused_kernels not found (#{reason})"}
          dir -> {:ok, Path.join([to_string(dir), "native", "libfused_kernels_nif"])}
        end
    end
  end

  @doc "`:ok` when the NIF is loaded, else `{:error, reason}`."
  @spec status() :: :ok | {:error, String.t()}
  def status, do: :persistent_term.get(@status_key, {:error, "NIF load not attempted"})

  @doc "Whether the NIF is loaded."
  @spec loaded?() :: boolean
  def loaded?, do: status() == :ok

  @doc "Raises for an error tuple; returns the value of `{:ok, value}`."
  @spec unwrap!(reply) :: term
  def unwrap!({:ok, value}), do: value
  def unwrap!({:error, {:argument, message}}), do: raise(ArgumentError, message)

  def unwrap!({:error, {kind, message}}),
    do: raise(FusedKernels.Error, kind: kind, message: message)

  # What every stub answers. It is read back from :persistent_term (written at load), so the
  # compiler's type checker sees a stub's result as what the real NIF returns, not as the one
  # error tuple a stub could build, and does not call the callers' {:ok, _} clauses dead.
  defp not_loaded do
    :persistent_term.get(@stub_key, {:error, {:nif_not_loaded, "NIF load not attempted"}})
  end

  # NIF stubs, replaced when the library loads.
  @doc false
  @spec info(term) :: map | reply
  def info(_device), do: not_loaded()
  @doc false
  @spec set_cache_dir(term) :: reply
  def set_cache_dir(_path), do: not_loaded()
  @doc false
  @spec kernel_prefill(term, term, term, term) :: reply
  def kernel_prefill(_archs, _route_as, _dir, _jobs), do: not_loaded()
  @doc false
  @spec kernel_warmup(term, term) :: reply
  def kernel_warmup(_ops, _device), do: not_loaded()
  @doc false
  @spec buffer_upload(term, term) :: reply
  def buffer_upload(_tensor, _device), do: not_loaded()
  @doc false
  @spec buffer_download(term) :: reply
  def buffer_download(_buffer), do: not_loaded()
  @doc false
  @spec buffer_meta(term) :: reply
  def buffer_meta(_buffer), do: not_loaded()
  @doc false
  @spec cuda_mem_info(term) :: reply
  def cuda_mem_info(_device), do: not_loaded()
  @doc false
  @spec cuda_synchronize(term) :: reply
  def cuda_synchronize(_device), do: not_loaded()

  # The ops. `op(...)` runs `op_dirty(...)` (a dirty CPU scheduler) for CUDA, and queues
  # `op_async(...)` on the library's own worker threads for the CPU backend, waiting here for
  # the reply, so long CPU calls never hold the BEAM's schedulers (see
  # native/fused_kernels_nif/src/jobs.rs). The three functions of every op are generated from
  # this table: every op takes `(inputs, options)`, two maps decoded into typed structs on
  # the Rust side (native/fused_kernels_nif/src/terms.rs), the backend read from
  # `options.backend`; the prepared-weights calls run on the CPU only (`:cpu`). A short CPU
  # call (a prepared dense, an attention, a prepared LSTM/GRU call that took at most 5 ms last
  # time) continues on a dirty scheduler instead, and `op_async` answers its reply itself.
  @ops [
    scaled_softmax: :options,
    dense: :options,
    dense_prepared: :cpu,
    flash_attention: :options,
    rnn: :options,
    rnn_prepared: :cpu,
    selective_scan: :options,
    norm: :options,
    mamba_block: :options,
    stream_shift_append: :options,
    stream_reshape: :options,
    mamba_block_state: :options
  ]

  for {op, backend} <- @ops do
    names = [:inputs, :options]
    args = Enum.map(names, &Macro.var(&1, __MODULE__))
    unused = Enum.map(names, &Macro.var(:"_#{&1}", __MODULE__))
    terms = Enum.map(names, fn _ -> quote(do: term) end)
    dirty = :"#{op}_dirty"
    async = :"#{op}_async"

    backend =
      if backend == :cpu,
        do: :cpu,
        else: quote(do: backend_of(unquote(Macro.var(:options, __MODULE__))))

    @doc false
    @spec unquote(op)(unquote_splicing(terms)) :: reply
    def unquote(op)(unquote_splicing(args)),
      do: dispatch(unquote(backend), unquote(dirty), unquote(async), unquote(args))

    @doc false
    @spec unquote(dirty)(unquote_splicing(terms)) :: reply
    def unquote(dirty)(unquote_splicing(unused)), do: not_loaded()

    @doc false
    @spec unquote(async)(unquote_splicing(terms)) :: reference | reply
    def unquote(async)(unquote_splicing(unused)), do: not_loaded()
  end

  # The preparing and engine NIFs take `(inputs, options)` too; the engine's predict and
  # step answer a reference for the CPU engine (its reply follows as `{ref, reply}`).
  @doc false
  @spec dense_prepare(term, term) :: reply
  def dense_prepare(_inputs, _options), do: not_loaded()
  @doc false
  @spec rnn_prepare(term, term) :: reply
  def rnn_prepare(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_load(term, term) :: reply
  def engine_load(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_predict(term, term) :: reference | reply
  def engine_predict(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_init_state(term, term) :: reply
  def engine_init_state(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_step(term, term) :: reference | reply
  def engine_step(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_reset(term, term) :: reply
  def engine_reset(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_state_info(term, term) :: reply
  def engine_state_info(_inputs, _options), do: not_loaded()
  @doc false
  @spec engine_graphs(term, term) :: reply
  def engine_graphs(_inputs, _options), do: not_loaded()

  # Junk options (not a map) go to the dirty NIF, which refuses them.
  defp backend_of(%{backend: backend}), do: backend
  defp backend_of(_options), do: nil

  defp dispatch(:cpu, _dirty, async, args), do: await(apply(__MODULE__, async, args))
  defp dispatch(_backend, dirty, _async, args), do: apply(__MODULE__, dirty, args)

  # A job always replies (errors and panics included); the reference is unique to this call.
  defp await(ref) when is_reference(ref) do
    receive do
      {^ref, result} -> result
    end
  end

  defp await(not_loaded), do: not_loaded
end
