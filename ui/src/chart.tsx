// Charts drawn by uPlot (a small, maintained time-series library): the
// Raft replication lag per peer, request and error rates per backend
// cluster, and the run timeline of a schedule. Colours follow the theme.
import uPlot from "uplot";
import { useEffect, useRef } from "preact/hooks";

const palette = ["#2f7ed8", "#e4572e", "#17a35c", "#a259d9", "#d9a400", "#0fa3b1", "#c2185b", "#6d7a89"];

export function seriesColor(i: number): string {
  return palette[i % palette.length];
}

function themeColors() {
  const cs = getComputedStyle(document.documentElement);
  return { fg: cs.getPropertyValue("--fg").trim() || "#222", grid: cs.getPropertyValue("--grid").trim() || "#ddd" };
}

export interface ChartProps {
  /** label read by screen readers: what the chart shows */
  label: string;
  /** x: seconds since the epoch; one array per series, same length */
  data: uPlot.AlignedData;
  series: { label: string; color?: string; points?: boolean; width?: number }[];
  yLabel: string;
  height?: number;
  /** y values name categories (a timeline): tick i shows categories[i] */
  categories?: string[];
  /** summary: the chart's numbers as text, for those who do not see it */
  summary: string;
  /** xRange: the time span shown (seconds); default: the data's */
  xRange?: [number, number];
}

/** fitX applies the x scale's range function (uPlot only calls it for auto scales). */
function fitX(u: uPlot) {
  const [min, max] = (u.scales.x.range as (u: uPlot, min: number, max: number, key: string) => uPlot.Range.MinMax)(u, 0, 0, "x");
  if (min !== null && max !== null) u.setScale("x", { min, max });
}

/** Chart is a uPlot time-series chart that resizes with its container. */
export function Chart(props: ChartProps) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const xRange = useRef(props.xRange);
  xRange.current = props.xRange;
  const shape = JSON.stringify([props.series.map((s) => s.label), props.categories, props.height]);

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const { fg, grid } = themeColors();
    const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid } };
    const opts: uPlot.Options = {
      width: Math.max(el.clientWidth, 200),
      height: props.height ?? 200,
      legend: { show: true },
      cursor: { drag: { x: false, y: false } },
      scales: {
        // At least a minute wide, so that one point is not spread over years.
        x: {
          time: true,
          auto: false,
          range: (u: uPlot): uPlot.Range.MinMax => {
            if (xRange.current) return xRange.current;
            const xs = u.data[0];
            const min = xs.length ? xs[0] : Date.now() / 1000 - 60;
            const max = xs.length ? xs[xs.length - 1] : Date.now() / 1000;
            const pad = Math.max((max - min) * 0.03, 30 - (max - min) / 2, 1);
            return [min - pad, max + pad];
          },
        },
        ...(props.categories ? { y: { range: [-0.5, props.categories.length - 0.5] as uPlot.Range.MinMax } } : {}),
      },
      axes: [
        axis,
        {
          ...axis,
          // A timeline's lanes name themselves.
          label: props.categories ? undefined : props.yLabel,
          size: props.categories ? 150 : 60,
          ...(props.categories
            ? {
                splits: () => props.categories!.map((_, i) => i),
                values: (_u: uPlot, vals: number[]) => vals.map((v) => props.categories![v] ?? ""),
              }
            : {}),
        },
      ],
      series: [
        {},
        ...props.series.map((s, i) => ({
          label: s.label,
          stroke: s.color ?? seriesColor(i),
          width: s.points ? 0 : (s.width ?? 2),
          points: s.points ? { show: true, size: 9, fill: s.color ?? seriesColor(i) } : { show: false },
          spanGaps: false,
        })),
      ],
    };
    const u = new uPlot(opts, props.data, el);
    plot.current = u;
    fitX(u);
    const ro = new ResizeObserver(() => u.setSize({ width: Math.max(el.clientWidth, 200), height: props.height ?? 200 }));
    ro.observe(el);
    const mq = matchMedia("(prefers-color-scheme: dark)");
    const retheme = () => {
      const c = themeColors();
      u.axes.forEach((a) => {
        a.stroke = () => c.fg;
      });
      u.redraw(false, true);
    };
    mq.addEventListener("change", retheme);
    return () => {
      ro.disconnect();
      mq.removeEventListener("change", retheme);
      u.destroy();
      plot.current = null;
    };
  }, [shape]);

  useEffect(() => {
    const u = plot.current;
    if (!u) return;
    u.setData(props.data, false);
    fitX(u);
  }, [props.data, props.xRange?.[0], props.xRange?.[1]]);

  return (
    <figure class="chart">
      <div ref={box} role="img" aria-label={`${props.label}: ${props.summary}`} />
      <figcaption>{props.label}</figcaption>
    </figure>
  );
}
