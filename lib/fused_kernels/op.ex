defmodule FusedKernels.Op do
  @moduledoc """
  What an op offers to graphs (`FusedKernels.Axon.Call` runs it inside `Axon`/`defn`): the
  fused call on concrete tensors, the pure-Nx implementation (traceable, differentiable, the
  fallback) and the shape and type of the result, all over the same tuple of inputs and the
  same options. The op's own options are validated by `FusedKernels.Options` before a backend
  is chosen, so both paths refuse the same arguments.

  The names are `fused_call/2` and `nx_call/2` rather than `native/2` and `nx/2` because the
  op modules' public `native/2` and `nx/2` (e.g. `FusedKernels.ScaledSoftmax.native(x, opts)`)
  take bare tensors, not an inputs tuple.
  """

  @typedoc "The op's inputs, in the op's order (tensors, or maps of parameters)."
  @type inputs :: tuple

  @doc "Runs the fused kernel (`:cuda` or `:cpu`) on concrete tensors."
  @callback fused_call(inputs, keyword) :: term

  @doc "The pure-Nx implementation: the same result, traceable inside `defn`."
  @callback nx_call(inputs, keyword) :: term

  @doc "The result's shape and type (`Nx.template/2`s), without computing it."
  @callback output_template(inputs, keyword) :: term
end
