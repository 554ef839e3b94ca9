package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// failoverTransport sends each request to the endpoint that last answered
// and, when an agent cannot be connected to at all (refused, unreachable,
// dial timeout), to the next endpoint of --endpoint, as etcdctl does. Only
// connection failures move on: the request was not sent, so any request,
// a write included, may go to the next agent. A request that reached an
// agent keeps that agent's answer; the retry interceptor decides whether to
// send it again.
//
// The clients are built on the first endpoint's URL; the transport rewrites
// scheme, host and path prefix for the others.
type failoverTransport struct {
	base      http.RoundTripper
	endpoints []*url.URL
	app       *app

	mu     sync.Mutex
	cur    int  // index of the endpoint that answered last
	warned bool // the all-endpoints-down warning was printed
}

func (t *failoverTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.mu.Lock()
	start := t.cur
	t.mu.Unlock()
	n := len(t.endpoints)
	var errs []string
	for i := range n {
		idx := (start + i) % n
		r, ok := t.requestTo(req, idx, i > 0)
		if !ok {
			break
		}
		resp, err := t.base.RoundTrip(r)
		if tlsRefusal(err) {
			// A retry on the same connection pool may then only say
			// "client conn could not be established": the refusal is
			// what the error report must explain.
			t.app.tlsRefused.Store(true)
		}
		if err == nil {
			t.mu.Lock()
			t.cur, t.warned = idx, false
			t.mu.Unlock()
			return resp, nil
		}
		if !dialFailure(err) || req.Context().Err() != nil {
			return nil, err
		}
		errs = append(errs, fmt.Sprintf("%s: %s", t.endpoints[idx].Host, dialReason(err)))
		if i+1 == n || !resendable(req) {
			t.warnAllDown(errs)
			return nil, err
		}
		if t.app.opts.verbose {
			fmt.Fprintf(t.app.stderr, "cannot connect to %s (%s); trying %s\n", t.endpoints[idx].Host, dialReason(err), t.endpoints[(idx+1)%n].Host)
		}
	}
	return nil, errors.New("no endpoint to try")
}

// requestTo is req aimed at endpoint idx; again means the request was
// tried before, so its body must be made anew (false when it cannot be: a
// client stream's body is sent once).
func (t *failoverTransport) requestTo(req *http.Request, idx int, again bool) (*http.Request, bool) {
	if !again && idx == 0 {
		return req, true
	}
	r := req.Clone(req.Context())
	if again && req.Body != nil && req.Body != http.NoBody {
		if !resendable(req) {
			return nil, false
		}
		body, err := req.GetBody()
		if err != nil {
			return nil, false
		}
		r.Body = body
	}
	ep := t.endpoints[idx]
	r.URL.Scheme, r.URL.Host = ep.Scheme, ep.Host
	r.URL.Path = ep.Path + strings.TrimPrefix(req.URL.Path, t.endpoints[0].Path)
	r.Host = ""
	return r, true
}

// current is the endpoint that answered last (the first before any did).
func (t *failoverTransport) current() *url.URL {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.endpoints[t.cur]
}

// warnAllDown says once, while no endpoint can be connected to, that pvcli
// keeps retrying until --timeout: a stopped agent must not look like a hang.
func (t *failoverTransport) warnAllDown(errs []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.warned {
		return
	}
	t.warned = true
	what := "the agent"
	if len(t.endpoints) > 1 {
		what = fmt.Sprintf("any of the %d agents", len(t.endpoints))
	}
	fmt.Fprintf(t.app.stderr, "Cannot connect to %s (%s); retrying until --timeout %s. Is the agent running? Give other agents with --endpoint a,b,c.\n",
		what, strings.Join(errs, "; "), t.app.opts.timeout)
}

// dialFailure reports whether err happened while connecting, before any of
// the request was sent.
func dialFailure(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	var dns *net.DNSError
	return errors.As(err, &dns)
}

// dialReason is the short cause of a connection failure.
func dialReason(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		msg := op.Err.Error()
		if i := strings.LastIndex(msg, ": "); i >= 0 {
			msg = msg[i+2:]
		}
		return msg
	}
	return err.Error()
}

// resendable reports whether req's body can be made anew for another
// endpoint.
func resendable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}
