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

  @on_load :load_nif
  @status_key {__MODULE__, :status}

  @doc false
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
  def status, do: :persistent_term.get(@status_key, {:error, "NIF load not attempted"})

  def loaded?, do: status() == :ok

  @doc "Raises for an error tuple; returns the value of `{:ok, value}`."
  def unwrap!({:ok, value}), do: value
  def unwrap!({:error, {:argument, message}}), do: raise(ArgumentError, message)

  def unwrap!({:error, {kind, message}}),
    do: raise(FusedKernels.Error, kind: kind, message: message)

  defp not_loaded do
    reason =
      case status() do
        {:error, r} -> r
        :ok -> "NIF stub called although the library loaded"
      end

    {:error, {:nif_not_loaded, reason}}
  end

  # NIF stubs, replaced when the library loads.
  @doc false
  def info(_device), do: not_loaded()
  @doc false
  def set_cache_dir(_path), do: not_loaded()
  @doc false
  def buffer_upload(_tensor, _device), do: not_loaded()
  @doc false
  def buffer_download(_buffer), do: not_loaded()
  @doc false
  def buffer_meta(_buffer), do: not_loaded()
  @doc false
  def cuda_mem_info(_device), do: not_loaded()
  @doc false
  def cuda_synchronize(_device), do: not_loaded()
  @doc false
  def scaled_softmax(_x, _scale, _causal, _backend, _device, _out), do: not_loaded()
  @doc false
  def dense(_kind, _operands, _activation, _eps, _backend, _device, _out), do: not_loaded()
  @doc false
  def flash_attention(
        _q,
        _k,
        _v,
        _layout,
        _scale,
        _causal,
        _window,
        _lse,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  def rnn(_cell, _x, _layers, _reverse, _backend, _device, _out, _precision),
    do: not_loaded()

  @doc false
  def selective_scan(
        _u,
        _delta,
        _a,
        _b,
        _c,
        _d,
        _z,
        _bias,
        _h0,
        _sp,
        _disc,
        _last,
        _be,
        _dev,
        _out
      ),
      do: not_loaded()

  @doc false
  def norm(_kind, _x, _weight, _bias, _residual, _eps, _backend, _device, _out), do: not_loaded()
  @doc false
  def mamba_block(
        _x,
        _weights,
        _eps,
        _dt_min,
        _dt_max,
        _disc,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()

  @doc false
  def engine_load(_spec, _params, _backend, _device), do: not_loaded()
  @doc false
  def engine_predict(_engine, _window), do: not_loaded()
  @doc false
  def engine_init_state(_engine, _batch), do: not_loaded()
  @doc false
  def engine_step(_engine, _state, _frame), do: not_loaded()
  @doc false
  def engine_reset(_state), do: not_loaded()
  @doc false
  def engine_state_info(_state), do: not_loaded()
  @doc false
  def stream_shift_append(_cache, _row, _backend, _device, _out), do: not_loaded()
  @doc false
  def stream_reshape(_x, _shape, _backend, _device, _out), do: not_loaded()
  @doc false
  def mamba_block_state(
        _x,
        _weights,
        _conv_state,
        _ssm_state,
        _eps,
        _dt_min,
        _dt_max,
        _disc,
        _residual,
        _backend,
        _device,
        _out
      ),
      do: not_loaded()
end
