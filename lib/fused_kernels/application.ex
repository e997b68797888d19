defmodule FusedKernels.Application do
  @moduledoc false
  use Application

  @impl true
  @spec start(Application.start_type(), term) :: {:ok, pid} | {:error, term}
  def start(_type, _args) do
    # `config :fused_kernels, cache_dir: "..."` overrides FUSED_KERNELS_CACHE_DIR and the
    # user cache dir for compiled kernels.
    with dir when is_binary(dir) <- Application.get_env(:fused_kernels, :cache_dir),
         true <- FusedKernels.Native.loaded?() do
      FusedKernels.Native.set_cache_dir(dir)
    end

    Supervisor.start_link([], strategy: :one_for_one, name: FusedKernels.Supervisor)
  end
end
