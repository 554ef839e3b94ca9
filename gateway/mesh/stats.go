package mesh

import (
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"
)

// Stats are the proxy's metrics (spec service-mesh "Observability"):
// pivirt_mesh_requests_total{service,status},
// pivirt_mesh_request_duration_seconds{service} and
// pivirt_mesh_active_connections{service}. service is the backend cluster;
// status is the HTTP status equivalent of the call's gRPC code.
type Stats struct {
	// byService caches each cluster's metric children (*serviceStats).
	byService sync.Map
	requests  *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	inflight  *prometheus.GaugeVec
	retries   *prometheus.CounterVec
	ejected   *prometheus.CounterVec
}

// NewStats registers the metrics with reg.
func NewStats(reg prometheus.Registerer) *Stats {
	s := &Stats{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_mesh_requests_total",
			Help: "Calls proxied to backend clusters, by cluster and HTTP status equivalent of the gRPC status.",
		}, []string{"service", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "pivirt_mesh_request_duration_seconds",
			Help:    "Duration of proxied calls, all attempts included, by backend cluster.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"service"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "pivirt_mesh_active_connections",
			Help: "Calls in flight to each backend cluster.",
		}, []string{"service"}),
	}
	s.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pivirt_mesh_retries_total",
		Help: "Attempts made again after a retryable failure, by backend cluster.",
	}, []string{"service"})
	s.ejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pivirt_mesh_ejections_total",
		Help: "Endpoints ejected by outlier detection (circuit_breaking), by backend cluster.",
	}, []string{"service"})
	reg.MustRegister(s.requests, s.duration, s.inflight, s.retries, s.ejected)
	return s
}

// serviceStats are one cluster's metric children, looked up once.
type serviceStats struct {
	duration prometheus.Observer
	inflight prometheus.Gauge
	requests [codes.Unauthenticated + 1]prometheus.Counter
}

func (s *Stats) service(name string) *serviceStats {
	if v, ok := s.byService.Load(name); ok {
		return v.(*serviceStats)
	}
	ss := &serviceStats{duration: s.duration.WithLabelValues(name), inflight: s.inflight.WithLabelValues(name)}
	for c := range ss.requests {
		ss.requests[c] = s.requests.WithLabelValues(name, strconv.Itoa(HTTPStatus(codes.Code(c))))
	}
	v, _ := s.byService.LoadOrStore(name, ss)
	return v.(*serviceStats)
}

func (s *Stats) observe(service string, code codes.Code, d time.Duration) {
	ss := s.service(service)
	if int(code) < len(ss.requests) {
		ss.requests[code].Inc()
	} else {
		s.requests.WithLabelValues(service, strconv.Itoa(HTTPStatus(code))).Inc()
	}
	ss.duration.Observe(d.Seconds())
}

func (s *Stats) retry(service string) { s.retries.WithLabelValues(service).Inc() }

// Ejected counts an ejection of an endpoint of service.
func (s *Stats) Ejected(service string) { s.ejected.WithLabelValues(service).Inc() }

func (s *Stats) active(service string) func() {
	g := s.service(service).inflight
	g.Inc()
	return g.Dec
}

// HTTPStatus maps a gRPC code to the HTTP status the Connect protocol uses
// for it.
func HTTPStatus(c codes.Code) int {
	switch c {
	case codes.OK:
		return 200
	case codes.Canceled:
		return 499
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return 400
	case codes.DeadlineExceeded:
		return 504
	case codes.NotFound:
		return 404
	case codes.AlreadyExists, codes.Aborted:
		return 409
	case codes.PermissionDenied:
		return 403
	case codes.ResourceExhausted:
		return 429
	case codes.Unimplemented:
		return 501
	case codes.Unavailable:
		return 503
	case codes.Unauthenticated:
		return 401
	default:
		return 500
	}
}

// endpointCollector exports pivirt_mesh_endpoints{service,status}: the
// endpoints of each backend cluster by status (healthy, unhealthy,
// ejected), read at scrape time.
type endpointCollector struct {
	backends func() []*Backend
	desc     *prometheus.Desc
}

// RegisterEndpoints exports the endpoint counts of backends with reg.
func RegisterEndpoints(reg prometheus.Registerer, backends func() []*Backend) {
	reg.MustRegister(&endpointCollector{backends: backends, desc: prometheus.NewDesc("pivirt_mesh_endpoints",
		"Endpoints of each backend cluster by status: healthy, unhealthy (active health checks) or ejected (circuit breaking).",
		[]string{"service", "status"}, nil)})
}

func (c *endpointCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *endpointCollector) Collect(ch chan<- prometheus.Metric) {
	for _, b := range c.backends() {
		counts := map[string]int{"healthy": 0, "unhealthy": 0, "ejected": 0}
		for _, e := range b.Endpoints() {
			counts[e.Status()]++
		}
		for st, n := range counts {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), b.Name(), st)
		}
	}
}

// Totals are one backend cluster's proxied calls since the agent started.
type Totals struct {
	// Requests counts every call; Errors those whose gRPC status was not
	// OK (an HTTP status equivalent other than 200).
	Requests, Errors uint64
}

// Totals reads pivirt_mesh_requests_total back, per backend cluster: the
// counters the proxy keeps, not a count of its own.
func (s *Stats) Totals() map[string]Totals {
	out := map[string]Totals{}
	ch := make(chan prometheus.Metric, 64)
	go func() {
		s.requests.Collect(ch)
		close(ch)
	}()
	for m := range ch {
		var d dto.Metric
		if m.Write(&d) != nil || d.GetCounter() == nil {
			continue
		}
		var service, status string
		for _, l := range d.GetLabel() {
			switch l.GetName() {
			case "service":
				service = l.GetValue()
			case "status":
				status = l.GetValue()
			}
		}
		n := uint64(d.GetCounter().GetValue())
		t := out[service]
		t.Requests += n
		if status != "200" {
			t.Errors += n
		}
		out[service] = t
	}
	return out
}
