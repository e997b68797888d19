if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.Axon.Call do
    @moduledoc """
    Runs a fused op from inside a `defn` graph (an Axon model).

    With EXLA's `EXLA.CustomCall` loaded the op becomes XLA custom calls where the handlers
    serve it (`exla/3`, `FusedKernels.XLA`). Otherwise, on Nx ≥ 0.11, the op becomes an
    `Nx.runtime_call/4` to the native kernel, wrapped in
    `custom_grad` whose backward pass is the gradient of the op's pure-Nx implementation:
    inference runs the kernel, training still gets exact gradients. On older Nx, or when no
    native backend is available, the pure-Nx implementation is traced into the graph instead
    (logged once). Nothing here raises at trace time because a GPU is missing.

    An op module provides `fused_call(inputs, opts)` (concrete tensors in, native kernel),
    `nx_call(inputs, opts)` (pure Nx, traceable) and `output_template(inputs, opts)`, where
    `inputs` is a tuple of tensors or containers (e.g. Axon's parameter maps) and the outputs
    any Nx container.
    """

    require Logger

    @doc "Whether this Nx has `Nx.runtime_call/4`."
    @spec runtime_call?() :: boolean
    def runtime_call? do
      Code.ensure_loaded?(Nx) and function_exported?(Nx, :runtime_call, 4)
    end

    @doc """
    The path a fused layer takes here: `:exla` (an XLA FFI custom call, when EXLA's
    `EXLA.CustomCall` is loaded: see `FusedKernels.XLA`), `:runtime_call` or `:nx`.
    """
    @spec path(keyword) :: :exla | :runtime_call | :nx
    def path(opts \\ []) do
      requested = FusedKernels.Backend.requested(opts)
      native? = requested in [:auto, :cuda, :cpu] and FusedKernels.Native.loaded?()

      cond do
        requested in [:auto, :cuda] and FusedKernels.XLA.available?() -> :exla
        runtime_call?() and native? -> :runtime_call
        true -> :nx
      end
    end

    @doc "Runs `op` on `inputs` (a tuple of tensors) inside or outside `defn`."
    @spec run(module, tuple, keyword) :: term
    def run(op, inputs, opts) when is_tuple(inputs) do
      case path(opts) do
        :exla ->
          # A call the handlers do not serve takes the next path.
          with :skip <- exla(op, inputs, opts),
               do: run_native_or_nx(op, inputs, opts, runtime_call?() and native?(opts))

        other ->
          run_native_or_nx(op, inputs, opts, other == :runtime_call)
      end
    end

    @doc """
    `op` on `inputs` as XLA custom calls (`Nx.block/4` nodes, see `FusedKernels.XLA`) under
    the pure-Nx gradient, when `path(opts)` is `:exla` and the handlers serve the call;
    otherwise `:skip`, and the caller takes its next path.
    """
    @spec exla(module, tuple, keyword) :: term | :skip
    def exla(op, inputs, opts) when is_tuple(inputs) do
      if path(opts) == :exla,
        do: with_pure_grad(op, inputs, opts, &exla_leaves/3),
        else: :skip
    end

    defp native?(opts),
      do:
        FusedKernels.Backend.requested(opts) in [:auto, :cuda, :cpu] and
          FusedKernels.Native.loaded?()

    defp run_native_or_nx(op, inputs, opts, true),
      do: with_pure_grad(op, inputs, opts, &runtime_call_leaves/3)

    defp run_native_or_nx(op, inputs, opts, false) do
      log_fallback_once(op)
      op.nx_call(inputs, opts)
    end

    # The op's output leaves from one runtime_call node.
    defp runtime_call_leaves(op, inputs, opts) do
      leaves = inputs |> op.output_template(opts) |> flatten()

      # runtime_call takes a flat tuple of output templates; the op's container is rebuilt
      # after the call. apply/3: Nx < 0.11 has no runtime_call (this branch runs on newer Nx).
      apply(Nx, :runtime_call, [
        List.to_tuple(leaves),
        inputs,
        [op: op, op_opts: opts],
        &__MODULE__.callback/2
      ])
      |> Tuple.to_list()
    end

    # The op's output leaves from XLA custom calls (`:skip` when not served).
    defp exla_leaves(FusedKernels.Axon.Ops.Attention, {x, params}, opts) do
      alias FusedKernels.XLA.Ops.FlashAttention

      dense = fn t, p ->
        ops = %{x: t, kernel: p["kernel"]}
        ops = if p["bias"] != nil, do: Map.put(ops, :bias, p["bias"]), else: ops

        case FusedKernels.XLA.run(FusedKernels.Axon.Ops.Dense, {ops}, []) do
          [y] -> y
          :skip -> FusedKernels.Axon.Ops.Dense.nx_call({ops}, [])
        end
      end

      attention = fn q, k, v, o ->
        case FusedKernels.XLA.run(FlashAttention, {q, k, v}, o) do
          [out, _lse] -> out
          :skip -> FusedKernels.FlashAttention.nx(q, k, v, o)
        end
      end

      x
      |> FusedKernels.Axon.Ops.Attention.forward(params, opts, %{
        dense: dense,
        attention: attention
      })
      |> List.wrap()
    end

    defp exla_leaves(op, inputs, opts), do: FusedKernels.XLA.run(op, inputs, opts)

    # Runs `forward` (the op's output leaves, or :skip) under a custom gradient: the
    # vector-Jacobian product of the op's pure-Nx implementation.
    defp with_pure_grad(op, inputs, opts, forward) do
      # Concrete tensors closed over by the caller become graph constants, so every input of
      # the node is part of the expression tree.
      inputs = Nx.Defn.Composite.traverse(inputs, &to_expr/1)
      template = op.output_template(inputs, opts)
      leaves = flatten(template)

      case forward.(op, inputs, opts) do
        :skip -> :skip
        outs -> pure_grad(op, inputs, opts, outs, template, leaves)
      end
    end

    defp pure_grad(op, inputs, opts, outs, template, leaves) do
      out = outs |> Enum.map(&Nx.reshape(&1, {Nx.size(&1)})) |> Nx.concatenate()

      # Inputs may hold parameter maps (Axon's kernels): gradients are per leaf tensor, and only
      # for symbolic leaves (a concrete tensor closed over by the caller has none).
      leaves_in = flatten(inputs)
      symbolic = for {t, i} <- Enum.with_index(leaves_in), FusedKernels.Tensor.symbolic?(t), do: i
      input_list = Enum.map(symbolic, &Enum.at(leaves_in, &1))

      # One flat tensor carries the custom gradient; its backward is the vector-Jacobian
      # product of the pure-Nx implementation.
      flat =
        Nx.Defn.Kernel.custom_grad(out, input_list, fn g ->
          g = Nx.Defn.Kernel.stop_grad(g)

          grads =
            Nx.Defn.grad(inputs, fn ins ->
              ins
              |> op.nx_call(opts)
              |> flatten()
              |> Enum.map(&Nx.flatten/1)
              |> Nx.concatenate()
              |> Nx.dot(g)
            end)

          all = flatten(grads)
          Enum.map(symbolic, &Enum.at(all, &1))
        end)

      unflatten(flat, template, leaves)
    end

    @doc false
    @spec callback(tuple, keyword) :: tuple
    def callback(inputs, opts),
      do: inputs |> opts[:op].fused_call(opts[:op_opts]) |> flatten() |> List.to_tuple()

    defp to_expr(t), do: if(FusedKernels.Tensor.symbolic?(t), do: t, else: Nx.Defn.Expr.tensor(t))

    defp flatten(container), do: Nx.Defn.Composite.flatten_list([container])

    defp unflatten(flat, template, leaves) do
      {parts, _} =
        Enum.map_reduce(leaves, 0, fn leaf, offset ->
          size = Nx.size(leaf)
          part = flat |> Nx.slice([offset], [size]) |> Nx.reshape(Nx.shape(leaf))
          {Nx.as_type(part, Nx.type(leaf)), offset + size}
        end)

      {out, []} =
        Nx.Defn.Composite.traverse(template, parts, fn _leaf, [p | rest] -> {p, rest} end)

      out
    end

    defp log_fallback_once(op) do
      key = {__MODULE__, :fallback_logged, op}

      unless :persistent_term.get(key, false) do
        :persistent_term.put(key, true)

        why =
          if runtime_call?(),
            do: "no native backend is available (#{inspect(FusedKernels.Native.status())})",
            else:
              "this Nx (#{Application.spec(:nx, :vsn)}) has no Nx.runtime_call/4 (needs ≥ 0.11)"

        Logger.info("fused_kernels: #{inspect(op)} runs its pure-Nx path inside graphs: #{why}")
      end
    end
  end
end
