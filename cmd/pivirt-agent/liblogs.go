package main

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"strings"

	"github.com/coreos/pkg/capnslog"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"
	"google.golang.org/grpc/grpclog"
)

// routeLibraryLogs sends what libraries print through their own global
// loggers to the agent's log, in its format (logging.format), each with a
// component: the standard library's log package ("stdlog"; capnslog, which
// raft-wal's file utilities pull in, takes it over at init and prints
// "2006-01-02 15:04:05 I | …" lines), capnslog's own loggers ("capnslog"),
// OpenTelemetry's errors and logs ("otel": an exporter that cannot reach its
// collector) and gRPC's ("grpc", errors at error level, the rest at debug
// as grpc-go's default shows only errors). Globals: main calls it once,
// before the agent starts.
func routeLibraryLogs(logger *slog.Logger) {
	std := slog.NewLogLogger(logger.With("component", "stdlog").Handler(), slog.LevelWarn)
	log.SetFlags(0)
	log.SetPrefix("")
	log.SetOutput(std.Writer())
	capnslog.SetFormatter(capnsFormatter{logger.With("component", "capnslog")})

	otelLog := logger.With("component", "otel")
	otel.SetLogger(logr.FromSlogHandler(otelLog.Handler()))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		otelLog.Warn("opentelemetry: " + err.Error())
	}))

	grpclog.SetLoggerV2(grpcLogger{logger.With("component", "grpc")})
}

// capnsFormatter is a capnslog.Formatter that logs through slog.
type capnsFormatter struct{ l *slog.Logger }

func (f capnsFormatter) Format(pkg string, level capnslog.LogLevel, _ int, entries ...any) {
	lv := slog.LevelInfo
	switch {
	case level <= capnslog.ERROR:
		lv = slog.LevelError
	case level == capnslog.WARNING:
		lv = slog.LevelWarn
	case level >= capnslog.DEBUG:
		lv = slog.LevelDebug
	}
	f.l.Log(context.Background(), lv, strings.TrimSuffix(fmt.Sprint(entries...), "\n"), "package", pkg)
}

func (capnsFormatter) Flush() {}

// grpcLogger is a grpclog.LoggerV2 that logs through slog.
type grpcLogger struct{ l *slog.Logger }

func (g grpcLogger) log(lv slog.Level, msg string) {
	g.l.Log(context.Background(), lv, strings.TrimSuffix(msg, "\n"))
}

func (g grpcLogger) Info(args ...any)   { g.log(slog.LevelDebug, fmt.Sprint(args...)) }
func (g grpcLogger) Infoln(args ...any) { g.log(slog.LevelDebug, fmt.Sprintln(args...)) }
func (g grpcLogger) Infof(format string, args ...any) {
	g.log(slog.LevelDebug, fmt.Sprintf(format, args...))
}
func (g grpcLogger) Warning(args ...any)   { g.log(slog.LevelDebug, fmt.Sprint(args...)) }
func (g grpcLogger) Warningln(args ...any) { g.log(slog.LevelDebug, fmt.Sprintln(args...)) }
func (g grpcLogger) Warningf(format string, args ...any) {
	g.log(slog.LevelDebug, fmt.Sprintf(format, args...))
}
func (g grpcLogger) Error(args ...any)   { g.log(slog.LevelError, fmt.Sprint(args...)) }
func (g grpcLogger) Errorln(args ...any) { g.log(slog.LevelError, fmt.Sprintln(args...)) }
func (g grpcLogger) Errorf(format string, args ...any) {
	g.log(slog.LevelError, fmt.Sprintf(format, args...))
}
func (g grpcLogger) Fatal(args ...any)   { g.log(slog.LevelError, fmt.Sprint(args...)); os.Exit(1) }
func (g grpcLogger) Fatalln(args ...any) { g.log(slog.LevelError, fmt.Sprintln(args...)); os.Exit(1) }
func (g grpcLogger) Fatalf(format string, args ...any) {
	g.log(slog.LevelError, fmt.Sprintf(format, args...))
	os.Exit(1)
}

// V reports whether verbosity level l is logged: grpc-go's verbose logs
// only at the debug level (logging.level debug shows the info ones).
func (grpcLogger) V(l int) bool { return l <= 0 }
