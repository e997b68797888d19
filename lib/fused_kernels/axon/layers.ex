if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.Axon.Layers do
    @moduledoc """
    Layer functions with the exact signatures of `Axon.Layers`' recurrent layers, so an Axon
    node can swap its op for them and keep its inputs and parameters. Each runs the fused op
    through `FusedKernels.Axon.Call` when it can and Axon's own implementation otherwise
    (a mask, or activations other than the defaults).
    """

    alias FusedKernels.Axon.Call

    @doc "Drop-in for `Axon.Layers.lstm/7`."
    @spec lstm(Nx.Tensor.t(), tuple, term, map, map, map, keyword) :: {Nx.Tensor.t(), tuple}
    def lstm(input, {c, h}, mask, input_kernel, hidden_kernel, bias, opts \\ []) do
      if fusable?(mask, opts) do
        Call.run(
          __MODULE__.LSTM,
          {input, c, h, input_kernel, hidden_kernel, bias},
          call_opts(opts)
        )
      else
        Axon.Layers.lstm(input, {c, h}, mask, input_kernel, hidden_kernel, bias, opts)
      end
    end

    @doc "Drop-in for `Axon.Layers.gru/7`."
    @spec gru(Nx.Tensor.t(), tuple, term, map, map, map, keyword) :: {Nx.Tensor.t(), tuple}
    def gru(input, {h}, mask, input_kernel, hidden_kernel, bias, opts \\ []) do
      if fusable?(mask, opts) do
        Call.run(__MODULE__.GRU, {input, h, input_kernel, hidden_kernel, bias}, call_opts(opts))
      else
        Axon.Layers.gru(input, {h}, mask, input_kernel, hidden_kernel, bias, opts)
      end
    end

    @doc false
    # The fused kernels implement tanh/sigmoid and no per-step mask; anything else keeps Axon's path.
    @spec fusable?(term, keyword) :: boolean
    def fusable?(mask, opts) do
      Keyword.get(opts, :activation, :tanh) == :tanh and
        Keyword.get(opts, :gate, :sigmoid) == :sigmoid and
        zero_mask?(mask)
    end

    defp zero_mask?(%Nx.Tensor{shape: {}, data: %Nx.Defn.Expr{op: :constant, args: [0]}}),
      do: true

    defp zero_mask?(%Nx.Tensor{shape: {}, data: %Nx.Defn.Expr{op: :tensor, args: [t]}}),
      do: zero_mask?(t)

    defp zero_mask?(%Nx.Tensor{shape: {}, data: %Nx.Defn.Expr{}}), do: false
    defp zero_mask?(%Nx.Tensor{shape: {}} = t), do: Nx.to_number(t) == 0
    defp zero_mask?(n) when is_number(n), do: n == 0
    defp zero_mask?(_), do: false

    defp call_opts(opts), do: Keyword.take(opts, [:backend, :device])

    defmodule LSTM do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {x, c, h, input_kernel, hidden_kernel, bias} (kernel/bias as Axon's maps)

      @impl FusedKernels.Op
      def fused_call({x, c, h, ik, hk, bias}, opts) do
        params = %{"input_kernel" => ik, "hidden_kernel" => hk, "bias" => bias}
        backend = if opts[:backend] in [nil, :nx], do: :auto, else: opts[:backend]
        FusedKernels.lstm(x, params, Keyword.merge(opts, initial_state: {c, h}, backend: backend))
      end

      @impl FusedKernels.Op
      def nx_call({x, c, h, ik, hk, bias}, _opts),
        do: Axon.Layers.lstm(x, {c, h}, 0, ik, hk, bias, unroll: :static)

      @impl FusedKernels.Op
      def output_template({x, c, h, ik, _hk, _bias}, _opts) do
        {b, t, _} = Nx.shape(x)
        units = elem(Nx.shape(h), 1)
        type = Nx.Type.merge(Nx.type(x), Nx.type(ik["wii"]))

        {Nx.template({b, t, units}, type),
         {Nx.template(Nx.shape(c), type), Nx.template(Nx.shape(h), type)}}
      end
    end

    defmodule GRU do
      @behaviour FusedKernels.Op
      @moduledoc false
      # inputs: {x, h, input_kernel, hidden_kernel, bias}

      @impl FusedKernels.Op
      def fused_call({x, h, ik, hk, bias}, opts) do
        params = %{"input_kernel" => ik, "hidden_kernel" => hk, "bias" => bias}
        backend = if opts[:backend] in [nil, :nx], do: :auto, else: opts[:backend]
        FusedKernels.gru(x, params, Keyword.merge(opts, initial_state: {h}, backend: backend))
      end

      @impl FusedKernels.Op
      def nx_call({x, h, ik, hk, bias}, _opts),
        do: Axon.Layers.gru(x, {h}, 0, ik, hk, bias, unroll: :static)

      @impl FusedKernels.Op
      def output_template({x, h, ik, _hk, _bias}, _opts) do
        {b, t, _} = Nx.shape(x)
        units = elem(Nx.shape(h), 1)
        type = Nx.Type.merge(Nx.type(x), Nx.type(ik["wir"]))
        {Nx.template({b, t, units}, type), {Nx.template(Nx.shape(h), type)}}
      end
    end
  end
end
