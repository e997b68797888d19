defmodule FusedKernels.Error do
  @moduledoc """
  A failure that is not the caller's argument: CUDA unavailable, out of GPU memory, a
  kernel that failed to compile, a CUDA driver error, or the NIF not loaded. `kind` says which.
  """
  defexception [:kind, :message]
end
