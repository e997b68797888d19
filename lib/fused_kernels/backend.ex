defmodule FusedKernels.Backend do
  @moduledoc """
  Where an op runs, decided in one place.

    * `:cuda` - the fused GPU kernels (needs the NIF, an NVIDIA driver and libnvrtc).
    * `:cpu` - the native CPU implementations in the NIF.
    * `:nx` - pure Nx: any Nx backend, and the only choice inside `defn`.
    * `:auto` (default) - `:cuda` when a GPU is usable, else `:cpu` when the NIF is loaded,
      else `:nx`; always `:nx` for symbolic tensors inside `defn`.

  The default comes from the `backend:` option, else `config :fused_kernels, backend: ...`,
  else `:auto`. The device comes from `device:`, else `config :fused_kernels, device: ...`,
  else `FUSED_KERNELS_DEVICE`, else 0.
  """

  @backends [:auto, :cuda, :cpu, :nx]
  @cuda_key {__MODULE__, :cuda_available}

  @doc "The requested backend, validated."
  @spec requested(keyword) :: :auto | :cuda | :cpu | :nx
  def requested(opts) do
    # An explicit `backend: nil` (op modules validate their options with a nil default) means
    # "not given".
    backend = Keyword.get(opts, :backend) || Application.get_env(:fused_kernels, :backend, :auto)

    if backend in @backends do
      backend
    else
      raise ArgumentError,
            "backend must be one of #{inspect(@backends)}, got: #{inspect(backend)}"
    end
  end

  @doc "The device option (nil: the native default)."
  @spec device(keyword) :: non_neg_integer | nil
  def device(opts) do
    case Keyword.get(opts, :device) || Application.get_env(:fused_kernels, :device) do
      nil ->
        nil

      d when is_integer(d) and d >= 0 ->
        d

      other ->
        raise ArgumentError, "device must be a non-negative integer, got: #{inspect(other)}"
    end
  end

  @doc "Whether the NIF is loaded and a GPU answered (probed once per VM)."
  @spec cuda_available?() :: boolean
  def cuda_available? do
    case :persistent_term.get(@cuda_key, nil) do
      nil ->
        available =
          FusedKernels.Native.loaded?() and
            match?(%{cuda_available: true}, FusedKernels.Native.info(nil))

        :persistent_term.put(@cuda_key, available)
        available

      available ->
        available
    end
  end

  @doc """
  Resolves the backend for a call. `symbolic?` is true when the inputs are `defn`
  expressions, which only the pure-Nx path can take.
  """
  @spec select(keyword, boolean) :: :cuda | :cpu | :nx
  def select(opts, symbolic? \\ false) do
    case {requested(opts), symbolic?} do
      {b, true} when b in [:auto, :nx] ->
        :nx

      {b, true} ->
        raise ArgumentError,
              "backend #{inspect(b)} cannot run inside defn (its inputs are symbolic); " <>
                "use backend: :auto or :nx there"

      {:auto, false} ->
        cond do
          cuda_available?() -> :cuda
          FusedKernels.Native.loaded?() -> :cpu
          true -> :nx
        end

      {:cuda, false} ->
        if cuda_available?() do
          :cuda
        else
          raise FusedKernels.Error,
            kind: :unavailable,
            message: "backend: :cuda was requested but #{unavailable_reason()}"
        end

      {:cpu, false} ->
        if FusedKernels.Native.loaded?() do
          :cpu
        else
          {:error, why} = FusedKernels.Native.status()

          raise FusedKernels.Error,
            kind: :nif_not_loaded,
            message: "backend: :cpu needs the native library, which did not load: #{why}"
        end

      {:nx, false} ->
        :nx
    end
  end

  @doc "A backend for callers that hold no Nx tensors (native triples or buffers)."
  @spec select_native(keyword) :: :cuda | :cpu
  def select_native(opts) do
    case select(opts) do
      :nx -> raise ArgumentError, "native calls take backend :auto, :cuda or :cpu, not :nx"
      b -> b
    end
  end

  # "CUDA is not available: <why>", said once: the native layer's reason already starts so.
  defp unavailable_reason do
    why =
      case FusedKernels.Native.status() do
        {:error, why} -> "the NIF did not load (#{why})"
        :ok -> Map.get(FusedKernels.Native.info(nil), :reason, "unknown")
      end

    "CUDA is not available: " <> String.replace_prefix(why, "CUDA is not available: ", "")
  end
end
