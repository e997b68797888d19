if Code.ensure_loaded?(EXLA.CustomCall) do
  defmodule FusedKernels.XLABlocks do
    @moduledoc false
    # The `Nx.block/4` nodes of a traced expression, as EXLA's compiler sees them
    # (`EXLA.Defn`'s :block clause calls `EXLA.CustomCall.call(struct, out, in_args, client)`).

    @doc "Every :block node of `container`'s expression: `{struct, in_args, out}`."
    def blocks(container) do
      {_, acc} =
        container
        |> List.wrap()
        |> Nx.Defn.Composite.flatten_list()
        |> Enum.reduce({MapSet.new(), []}, &walk/2)

      Enum.reverse(acc)
    end

    @doc "The blocks of `fun` traced on `args`."
    def traced(fun, args), do: blocks(apply(Nx.Defn.debug_expr(fun), args))

    @doc "What EXLA asks our implementation for every block of `fun` on `args`."
    def specs(fun, args, client) do
      for {struct, in_args, out} <- traced(fun, args),
          do: EXLA.CustomCall.call(struct, out, in_args, client)
    end

    @doc "A uniform random f32 (or `type`) tensor in [-1, 1)."
    def rand(shape, type \\ :f32),
      do:
        Nx.tensor(for(_ <- 1..Tuple.product(shape), do: :rand.uniform() * 2 - 1), type: type)
        |> Nx.reshape(shape)

    @doc "Axon's parameter map of one LSTM/GRU layer (input size f, h units)."
    def rnn_params(cell, f, h) do
      {i, hh, b} = FusedKernels.Rnn.gate_names(cell)

      %{
        "input_kernel" => Map.new(i, &{&1, rand({f, h})}),
        "hidden_kernel" => Map.new(hh, &{&1, rand({h, h})}),
        "bias" => Map.new(b, &{&1, rand({h})})
      }
    end

    @doc """
    Edifice's Mamba block parameters for block `name`; without `ssm?` no `a`/`d` (the block
    then uses Edifice's fixed A).
    """
    def mamba_params(name, h, inner, state, rank, ssm? \\ true) do
      %{
        "#{name}_norm" => %{"gamma" => rand({h}), "beta" => rand({h})},
        "#{name}_in_proj" => %{"kernel" => rand({h, 2 * inner}), "bias" => rand({2 * inner})},
        "#{name}_conv_dw_conv" => %{"kernel" => rand({4, 1, inner}), "bias" => rand({inner})},
        "#{name}_ssm_bc_proj" => %{"kernel" => rand({inner, 2 * state})},
        "#{name}_ssm_dt_rank" => %{"kernel" => rand({inner, rank})},
        "#{name}_ssm_dt_proj" => %{"kernel" => rand({rank, inner}), "bias" => rand({inner})},
        "#{name}_out_proj" => %{"kernel" => rand({inner, h})}
      }
      |> Map.merge(
        if ssm?,
          do: %{
            "#{name}_ssm" => %{
              "a" => Nx.negate(Nx.abs(rand({inner, state}))),
              "d" => rand({inner})
            }
          },
          else: %{}
      )
    end

    defp walk(%Nx.Tensor{data: %Nx.Defn.Expr{id: id, op: op, args: args}}, {seen, acc} = state) do
      if MapSet.member?(seen, id) do
        state
      else
        state = {MapSet.put(seen, id), acc}

        case {op, args} do
          {:block, [struct, in_args, out, _fun]} ->
            {s, a} = Enum.reduce(in_args, state, &walk/2)
            {s, [{struct, in_args, out} | a]}

          _ ->
            Enum.reduce(args, state, &walk_arg/2)
        end
      end
    end

    defp walk(_other, state), do: state

    defp walk_arg(%Nx.Tensor{} = t, state), do: walk(t, state)
    defp walk_arg(list, state) when is_list(list), do: Enum.reduce(list, state, &walk_arg/2)
    defp walk_arg(tuple, state) when is_tuple(tuple), do: walk_arg(Tuple.to_list(tuple), state)
    defp walk_arg(_, state), do: state
  end
end
