defmodule FusedKernels.Native do
  @moduledoc """
  The NIF, loaded when this module loads. Needs no Nx.

  Tensors cross as `{binary, shape_tuple, type}` triples (Nx's type tuples) or as device
  buffer references. Every function returns `{:ok, value}` or
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

  # The ops. `op/n` runs `op_dirty/n` (a dirty CPU scheduler) for CUDA, and queues `op_async/n`
  # on the library's own worker threads for the CPU backend, waiting here for the reply, so
  # long CPU calls never hold the BEAM's schedulers (see native/fused_kernels_nif/src/jobs.rs).
  @doc false
  @spec scaled_softmax(term, term, term, term, term, term) :: reply
  def scaled_softmax(x, scale, causal, backend, device, out),
    do:
      dispatch(backend, :scaled_softmax_dirty, :scaled_softmax_async, [
        x,
        scale,
        causal,
        backend,
        device,
        out
      ])

  @doc false
  @spec scaled_softmax_dirty(term, term, term, term, term, term) :: reply
  def scaled_softmax_dirty(_x, _scale, _causal, _backend, _device, _out), do: not_loaded()
  @doc false
  @spec scaled_softmax_async(term, term, term, term, term, term) :: reference | reply
  def scaled_softmax_async(_x, _scale, _causal, _backend, _device, _out), do: not_loaded()

  @doc false
  @spec dense(term, term, term, term, term, term, term) :: reply
  def dense(kind, operands, activation, eps, backend, device, out),
    do:
      dispatch(backend, :dense_dirty, :dense_async, [
        kind,
        operands,
        activation,
        eps,
        backend,
        device,
        out
      ])

  @doc false
  @spec dense_dirty(term, term, term, term, term, term, term) :: reply
  def dense_dirty(_kind, _operands, _activation, _eps, _backend, _device, _out), do: not_loaded()
  @doc false
  @spec dense_async(term, term, term, term, term, term, term) :: reference | reply
  def dense_async(_kind, _operands, _activation, _eps, _backend, _device, _out), do: not_loaded()

  @doc false
  @spec flash_attention(term, term, term, term, term, term, term, term, term, term, term) :: reply
  def flash_attention(q, k, v, layout, scale, causal, window, return_lse, backend, device, out),
    do:
      dispatch(backend, :flash_attention_dirty, :flash_attention_async, [
        q,
        k,
        v,
        layout,
        scale,
        causal,
        window,
        return_lse,
        backend,
        device,
        out
      ])

  @doc false
  @spec flash_attention_dirty(term, term, term, term, term, term, term, term, term, term, term) ::
          reply
  def flash_attention_dirty(
        _q,
        _k,
        _v,
        _layout,
        _scale,
        _causal,
        _window,
        _return_lse,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec flash_attention_async(term, term, term, term, term, term, term, term, term, term, term) ::
          reference | reply
  def flash_attention_async(
        _q,
        _k,
        _v,
        _layout,
        _scale,
        _causal,
        _window,
        _return_lse,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec rnn(term, term, term, term, term, term, term, term) :: reply
  def rnn(cell, x, layers, reverse, backend, device, out, precision),
    do:
      dispatch(backend, :rnn_dirty, :rnn_async, [
        cell,
        x,
        layers,
        reverse,
        backend,
        device,
        out,
        precision
      ])

  @doc false
  @spec rnn_dirty(term, term, term, term, term, term, term, term) :: reply
  def rnn_dirty(_cell, _x, _layers, _reverse, _backend, _device, _out, _precision),
    do: not_loaded()

  @doc false
  @spec rnn_async(term, term, term, term, term, term, term, term) :: reference | reply
  def rnn_async(_cell, _x, _layers, _reverse, _backend, _device, _out, _precision),
    do: not_loaded()

  @doc false
  @spec selective_scan(
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term
        ) :: reply
  def selective_scan(
        u,
        delta,
        a,
        b,
        c,
        d,
        z,
        delta_bias,
        initial_state,
        delta_softplus,
        discretization,
        return_last_state,
        backend,
        device,
        out
      ),
      do:
        dispatch(backend, :selective_scan_dirty, :selective_scan_async, [
          u,
          delta,
          a,
          b,
          c,
          d,
          z,
          delta_bias,
          initial_state,
          delta_softplus,
          discretization,
          return_last_state,
          backend,
          device,
          out
        ])

  @doc false
  @spec selective_scan_dirty(
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term
        ) :: reply
  def selective_scan_dirty(
        _u,
        _delta,
        _a,
        _b,
        _c,
        _d,
        _z,
        _delta_bias,
        _initial_state,
        _delta_softplus,
        _discretization,
        _return_last_state,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec selective_scan_async(
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term
        ) :: reference | reply
  def selective_scan_async(
        _u,
        _delta,
        _a,
        _b,
        _c,
        _d,
        _z,
        _delta_bias,
        _initial_state,
        _delta_softplus,
        _discretization,
        _return_last_state,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec norm(term, term, term, term, term, term, term, term, term) :: reply
  def norm(kind, x, weight, bias, residual, eps, backend, device, out),
    do:
      dispatch(backend, :norm_dirty, :norm_async, [
        kind,
        x,
        weight,
        bias,
        residual,
        eps,
        backend,
        device,
        out
      ])

  @doc false
  @spec norm_dirty(term, term, term, term, term, term, term, term, term) :: reply
  def norm_dirty(_kind, _x, _weight, _bias, _residual, _eps, _backend, _device, _out),
    do: not_loaded()

  @doc false
  @spec norm_async(term, term, term, term, term, term, term, term, term) :: reference | reply
  def norm_async(_kind, _x, _weight, _bias, _residual, _eps, _backend, _device, _out),
    do: not_loaded()

  @doc false
  @spec mamba_block(term, term, term, term, term, term, term, term, term, term) :: reply
  def mamba_block(
        x,
        weights,
        eps,
        dt_min,
        dt_max,
        discretization,
        residual,
        backend,
        device,
        out
      ),
      do:
        dispatch(backend, :mamba_block_dirty, :mamba_block_async, [
          x,
          weights,
          eps,
          dt_min,
          dt_max,
          discretization,
          residual,
          backend,
          device,
          out
        ])

  @doc false
  @spec mamba_block_dirty(term, term, term, term, term, term, term, term, term, term) :: reply
  def mamba_block_dirty(
        _x,
        _weights,
        _eps,
        _dt_min,
        _dt_max,
        _discretization,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec mamba_block_async(term, term, term, term, term, term, term, term, term, term) ::
          reference | reply
  def mamba_block_async(
        _x,
        _weights,
        _eps,
        _dt_min,
        _dt_max,
        _discretization,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec engine_load(term, term, term, term) :: reply
  def engine_load(_spec, _params, _backend, _device), do: not_loaded()
  @doc false
  @spec engine_predict(term, term) :: reference | reply
  def engine_predict(_engine, _window), do: not_loaded()
  @doc false
  @spec engine_init_state(term, term) :: reply
  def engine_init_state(_engine, _batch), do: not_loaded()
  @doc false
  @spec engine_step(term, term, term) :: reference | reply
  def engine_step(_engine, _state, _frame), do: not_loaded()
  @doc false
  @spec engine_reset(term, term) :: reply
  def engine_reset(_engine, _state), do: not_loaded()
  @doc false
  @spec engine_state_info(term) :: reply
  def engine_state_info(_state), do: not_loaded()
  @doc false
  @spec engine_graphs(term) :: reply
  def engine_graphs(_engine), do: not_loaded()

  @doc false
  @spec stream_shift_append(term, term, term, term, term) :: reply
  def stream_shift_append(cache, row, backend, device, out),
    do:
      dispatch(backend, :stream_shift_append_dirty, :stream_shift_append_async, [
        cache,
        row,
        backend,
        device,
        out
      ])

  @doc false
  @spec stream_shift_append_dirty(term, term, term, term, term) :: reply
  def stream_shift_append_dirty(_cache, _row, _backend, _device, _out), do: not_loaded()
  @doc false
  @spec stream_shift_append_async(term, term, term, term, term) :: reference | reply
  def stream_shift_append_async(_cache, _row, _backend, _device, _out), do: not_loaded()

  @doc false
  @spec stream_reshape(term, term, term, term, term) :: reply
  def stream_reshape(x, shape, backend, device, out),
    do:
      dispatch(backend, :stream_reshape_dirty, :stream_reshape_async, [
        x,
        shape,
        backend,
        device,
        out
      ])

  @doc false
  @spec stream_reshape_dirty(term, term, term, term, term) :: reply
  def stream_reshape_dirty(_x, _shape, _backend, _device, _out), do: not_loaded()
  @doc false
  @spec stream_reshape_async(term, term, term, term, term) :: reference | reply
  def stream_reshape_async(_x, _shape, _backend, _device, _out), do: not_loaded()

  @doc false
  @spec mamba_block_state(term, term, term, term, term, term, term, term, term, term, term, term) ::
          reply
  def mamba_block_state(
        x,
        weights,
        conv_state,
        ssm_state,
        eps,
        dt_min,
        dt_max,
        discretization,
        residual,
        backend,
        device,
        out
      ),
      do:
        dispatch(backend, :mamba_block_state_dirty, :mamba_block_state_async, [
          x,
          weights,
          conv_state,
          ssm_state,
          eps,
          dt_min,
          dt_max,
          discretization,
          residual,
          backend,
          device,
          out
        ])

  @doc false
  @spec mamba_block_state_dirty(
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term
        ) :: reply
  def mamba_block_state_dirty(
        _x,
        _weights,
        _conv_state,
        _ssm_state,
        _eps,
        _dt_min,
        _dt_max,
        _discretization,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  @spec mamba_block_state_async(
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term,
          term
        ) :: reference | reply
  def mamba_block_state_async(
        _x,
        _weights,
        _conv_state,
        _ssm_state,
        _eps,
        _dt_min,
        _dt_max,
        _discretization,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

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
