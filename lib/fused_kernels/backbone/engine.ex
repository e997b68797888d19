defmodule FusedKernels.Backbone.Engine do
  @moduledoc false
  # The native backbone engine behind `FusedKernels.Backbone` on the native backends: one
  # NIF resource built at load (weights converted and packed once), one NIF call per window
  # (`predict`) and per frame (`step`). A stream's state is a resource of the engine that made
  # it, updated in place by each step.

  alias FusedKernels.{Native, Tensor}
  alias FusedKernels.Backbone.Spec

  defmodule State do
    @moduledoc """
    A backbone stream's state: every layer's recurrent state, held natively and advanced in
    place by `FusedKernels.Backbone.step/3` (the returned state is this same state). Make one
    per stream with `FusedKernels.Backbone.init_state/2`; `FusedKernels.Backbone.reset/1`
    starts it over.
    """
    @enforce_keys [:ref, :batch]
    defstruct [:ref, :batch]

    @type t :: %__MODULE__{ref: reference(), batch: pos_integer()}
  end

  @doc "The engine resource for `spec` and the checked params map (names → tensors)."
  def load(%Spec{} = spec, params, backend, device) do
    %{params: flatten(params, "")}
    |> Native.engine_load(%{spec: Map.from_struct(spec), backend: backend, device: device})
    |> Native.unwrap!()
  end

  # "layer/group/name" → triple, for every tensor of the params tree.
  defp flatten(%{} = m, prefix) when not is_struct(m) do
    Enum.flat_map(m, fn {k, v} ->
      flatten(v, if(prefix == "", do: to_string(k), else: prefix <> "/" <> to_string(k)))
    end)
  end

  defp flatten(t, name), do: [{name, Tensor.to_native(t)}]

  def predict(ref, window) do
    %{engine: ref, window: host_in(window, "window")}
    |> Native.engine_predict(%{})
    |> await()
    |> Native.unwrap!()
    |> back(window)
  end

  def init_state(ref, batch) do
    state = %{engine: ref} |> Native.engine_init_state(%{batch: batch}) |> Native.unwrap!()
    %State{ref: state, batch: batch}
  end

  def step(ref, %State{ref: s} = state, frame) do
    out =
      %{engine: ref, state: s, frame: host_in(frame, "frame")}
      |> Native.engine_step(%{})
      |> await()
      |> Native.unwrap!()

    {back(out, frame), state}
  end

  # The CPU engine's long calls run on the library's job lanes: the NIF answers a reference
  # and the reply follows as `{ref, reply}` (it always comes, errors and panics included). Its
  # short calls (continued on a dirty scheduler), the CUDA engine's calls and every argument
  # error are answered by the NIF itself.
  defp await(ref) when is_reference(ref) do
    receive do
      {^ref, reply} -> reply
    end
  end

  defp await(reply), do: reply

  def reset(ref, %State{ref: s} = state) do
    %{engine: ref, state: s} |> Native.engine_reset(%{}) |> Native.unwrap!()
    state
  end

  # Per shape run on the GPU: `{batch, seq, :window | :frame, notes}`, each note "graph"
  # (replayed) or "eager: why" (capture failed); [] on the CPU.
  def graphs(ref), do: %{engine: ref} |> Native.engine_graphs(%{}) |> Native.unwrap!()

  defp host_in(%FusedKernels.Buffer{} = b, _what), do: FusedKernels.Buffer.download(b)

  defp host_in(t, what) do
    Tensor.to_native(t)
  rescue
    e in ArgumentError ->
      reraise ArgumentError, "#{what}: #{Exception.message(e)}", __STACKTRACE__
  end

  defp back(triple, {_, _, _}), do: triple
  defp back(triple, %FusedKernels.Buffer{}), do: triple

  # Nx tensors reach here only when Nx is loaded (host_in/2 refuses them otherwise).
  if Code.ensure_loaded?(Nx) do
    defp back(triple, _nx_tensor), do: Tensor.to_nx(triple)
  end
end
