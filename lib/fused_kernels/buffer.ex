defmodule FusedKernels.Buffer do
  @moduledoc """
  A tensor that lives on a GPU. Upload weights or state once, pass the buffer to ops as often
  as you like, and ask ops for `out: :device` to keep results there. The GPU memory is freed
  when the BEAM garbage-collects the last reference.
  """

  alias FusedKernels.Native

  @enforce_keys [:ref, :shape, :type, :device]
  defstruct [:ref, :shape, :type, :device]

  @type t :: %__MODULE__{
          ref: reference(),
          shape: tuple(),
          type: tuple(),
          device: non_neg_integer()
        }

  @doc "Uploads a `{binary, shape, type}` triple (or an Nx tensor, when Nx is loaded)."
  @spec upload(FusedKernels.Tensor.t(), keyword) :: t
  def upload(tensor, opts \\ []) do
    tensor
    |> FusedKernels.Tensor.to_native()
    |> Native.buffer_upload(FusedKernels.Backend.device(opts))
    |> Native.unwrap!()
    |> wrap()
  end

  @doc "Copies a buffer back as a `{binary, shape, type}` triple."
  @spec download(t) :: FusedKernels.Tensor.triple()
  def download(%__MODULE__{ref: ref}), do: ref |> Native.buffer_download() |> Native.unwrap!()

  def download(other),
    do: raise(ArgumentError, "expected a FusedKernels.Buffer, got: #{inspect(other, limit: 5)}")

  @doc false
  @spec wrap(reference | FusedKernels.Tensor.triple()) :: t | FusedKernels.Tensor.triple()
  def wrap(ref) when is_reference(ref) do
    {shape, type, device} = ref |> Native.buffer_meta() |> Native.unwrap!()
    %__MODULE__{ref: ref, shape: shape, type: type, device: device}
  end

  def wrap(triple) when is_tuple(triple), do: triple
end
