// Command monitoring holds what the project ships for Prometheus and
// Grafana to Prometheus's own code (github.com/prometheus/prometheus, from
// the module proxy): its PromQL engine, its alerting rules, its TSDB and
// its scrape parser, and prometheus-operator's API types.
//
//	monitoring rules  --rule-file F --tests T
//	monitoring panels --dashboard D --scrape node=FILE [--scrape ...]
//
// rules decodes the PrometheusRule F strictly with prometheus-operator's
// types and runs the unit tests in T, written as `promtool test rules`
// reads them (input series in the expanding notation, expected alerts at
// evaluation times), through Prometheus's alerting rules and engine.
//
// panels loads scrapes of running daemons (OpenMetrics text, each with the
// `node` label the ServiceMonitor adds) into a TSDB, and evaluates every
// query of every panel of the Grafana dashboard D with Prometheus's
// engine: a query that does not parse, fails, or returns no series fails.
package main

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: monitoring rules|panels ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "rules":
		err = rulesMain(os.Args[2:])
	case "panels":
		err = panelsMain(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "monitoring:", err)
		os.Exit(1)
	}
}
